"""cadenza.log"""
