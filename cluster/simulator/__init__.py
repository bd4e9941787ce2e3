"""The cluster simulator and pool planner behind ``dspark simulate`` (docs/SIMULATOR.md).

A discrete-event simulation of a deployment serving a workload that runs the project's own decision code: the
verification policies of :mod:`scheduler.policy`, the admission and routing rules of :mod:`scheduler.admission`
and the autoscaling policy of :mod:`cluster.autoscaling`, on confidences and acceptance from recorded decoding
traces and costs from a measured cost file. Modules, one role each:

- :mod:`.workload`: arrivals (Poisson, bursty, replayed log) and token lengths;
- :mod:`.traces`: recorded decoding traces (``dspark eval --save-traces``);
- :mod:`.costs`: the cost file of a GPU type and its loader;
- :mod:`.clock`: the event queue;
- :mod:`.replicas`: GPUs, verifier and drafter replicas, round drivers;
- :mod:`.router`: routing and admission on simulated replicas;
- :mod:`.autoscaler`: a pool's autoscaler on the simulated clock;
- :mod:`.simulation`: the round loop;
- :mod:`.report`: latency, throughput and goodput summaries;
- :mod:`.planner`: the best placement and drafter:verifier ratio for a GPU budget;
- :mod:`.cli`: ``dspark simulate run`` and ``dspark simulate plan``.

It imports downward only (scheduler, cluster.autoscaling, cluster.config for the served ``decode_steps`` default);
nothing in the serving path imports it.
"""
