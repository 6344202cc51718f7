"""cadenza.rl"""
