"""Rules: each resolved StepReport judged, and Flags raised and cleared by episode.

The backward/forward ratio (against the healthy bands measured per kernel), memory savings,
regression against a rolling or saved baseline, and the hang check.
"""
