"""Capture: what sees each attention call and times it on the device.

The op table and its Python interceptors, the dispatcher tap, the device timers and the native
extension they run in, and the autograd-graph reading that finds a call's backward.
"""
