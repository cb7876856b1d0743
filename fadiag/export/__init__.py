"""Export: the sinks every StepReport and Flag goes to.

Prometheus (a collector over the latest reports, and its HTTP server), the JSONL run log, the
log, and the user's callback; one interface (`Sink`), fanned out by `FanOut`.
"""
