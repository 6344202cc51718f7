"""cadenza.model"""
