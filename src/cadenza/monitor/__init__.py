"""cadenza.monitor"""
