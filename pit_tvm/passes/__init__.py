"""passes"""
