"""cadenza.tasks"""
