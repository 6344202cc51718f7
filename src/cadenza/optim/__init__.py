"""cadenza.optim"""
