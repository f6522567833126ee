"""Serve and learn: vLLM's own OpenAI-compatible server on the target and a draft, whose draft learns Draft-OPD
from the traffic it verifies (`python -m draft_opd_ray.serve`, docs/usage.md "Serve and learn").

    traffic.py  the captured verification steps of the server's requests, joined across takes into rollout
                records, and τ by draft version (no vLLM, no Ray)
    learn.py    the learner beside the server: a replay actor that turns the captured teacher into training items
                (no target forward) and a DeepSpeed learner rank, on Ray
    server.py   vLLM's API server built from its own launcher functions, with the capture installed through our
                worker extension, `GET /draft/status`, and the task that takes the traffic, steps the learner and
                refits each new version into the running engine (proved by the refit check)
    placement.py on GPUs, vLLM's engine on the first GPUs and the learner's side (a local Ray) on the others
    transfer.py where the learner has GPUs of its own, candidates go by vLLM's draft weight transfer (NCCL)
    counters.py spec-decode counters by draft version on vLLM's Prometheus /metrics
    rollback.py `python -m draft_opd_ray.serve.rollback RUN_DIR VERSION`: a running server back to a version it
                published, the request passed through the run dir (the port serves only vLLM's routes)
"""
