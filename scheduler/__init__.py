"""The confidence scheduler.

Decides every round, for every verifier replica, how many draft tokens each active request verifies:
Algorithm 1 of the DSpark paper (prefix survival probabilities, global greedy admission with the causal
early stop, objective = expected accepted tokens x SPS(batch tokens)) and its asynchronous capacity variant.
Also owns the SPS (steps-per-second) profiling table, STS confidence calibration, the request lifecycle and
round driver, routing with replica affinity, and the metrics the system exports.
"""
