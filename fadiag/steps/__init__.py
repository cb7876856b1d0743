"""Steps: captured calls grouped into training steps and resolved into StepReports.

The recorder runs on the training thread (which calls to measure, their marks, where a step
ends); the resolver on its own thread (device marks into seconds, CallRecords, StepReports).
"""
