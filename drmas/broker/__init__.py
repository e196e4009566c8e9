"""The broker (`drmas broker`), the one coordinator every other process talks to.

server.py     ROUTER socket loop: decode, validate, dispatch, reply
state.py      the rules: leases, staleness, versions, weight-group plans
admission.py  whether an actor may take another training group now
leases.py     who holds which task; buffers.py: per-model slices and batch cutting
advantages.py Dr. MAS agent-wise (and GRPO) advantages; evaluation.py: avg@k, pass@k
metrics.py    RUN_DIR/metrics.jsonl
"""
