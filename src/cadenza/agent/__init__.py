"""cadenza.agent"""
