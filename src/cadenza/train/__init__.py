"""cadenza.train"""
