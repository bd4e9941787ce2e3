"""``dspark bench serve``: a serving benchmark of any OpenAI-compatible server, measured as its users see it.

The package is a client: it knows HTTP and the OpenAI API, nothing of the engines, so it measures dspark-serve, vLLM
and SGLang alike. Nothing in the serving path imports it.

- :mod:`~cluster.bench_serve.workload`: what to send (prompt sets, random tokens, replayed traces);
- :mod:`~cluster.bench_serve.client`: one request through the ``openai`` client, timed per streamed chunk;
- :mod:`~cluster.bench_serve.load`: how to send it (closed loop at a concurrency, open loop at a request rate, a
  trace's own arrival times), with warm-up and a measured window;
- :mod:`~cluster.bench_serve.stats`: percentiles, tokens/s per user, goodput under an SLO;
- :mod:`~cluster.bench_serve.server_metrics`: the server's speculative-decoding counters from ``/metrics``;
- :mod:`~cluster.bench_serve.report`: JSON, markdown tables and plots of one run or several side by side;
- :mod:`~cluster.bench_serve.cli`: the ``dspark bench`` commands.
"""
