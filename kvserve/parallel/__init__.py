"""Parallel layouts of one replica's model over torch.distributed (gloo on CPU, NCCL on GPU).

- ``group.py``: ``RankGroup``, the ranks of one replica (loopback TCP store, its own process
  group object, no process-global default group), with the seconds its collectives took.
- ``tensor_parallel.py``: the tensor-parallel transform on a plain model (column-parallel
  q/k/v and gate/up, row-parallel o and down with one all-reduce each, vocabulary-parallel
  embedding and head, KV heads split or replicated).
- ``ranks.py``: the worker processes of ranks 1..N-1 and the command channel rank 0 drives
  them with; ``runner.py``: the runner that drives them (the scheduler does not change).
- ``auto.py``: ``--tensor-parallel-size auto`` from the planner's memory functions.
"""
