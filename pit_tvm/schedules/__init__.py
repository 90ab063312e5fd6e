"""schedules"""
