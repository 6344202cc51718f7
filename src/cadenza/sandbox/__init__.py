"""cadenza.sandbox"""
