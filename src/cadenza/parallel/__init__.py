"""cadenza.parallel"""
