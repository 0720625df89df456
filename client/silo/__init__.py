"""A silo: one Flower client that trains data-parallel inside and meets other silos over a
ring.

- ``job``: the ``torchrun`` job, rank 0 serving Flower, the other ranks following;
- ``app``: the silo's ClientApp (train, cross-silo rounds, secure aggregation);
- ``ring``: one cross-silo aggregation in a child process;
- ``training``: data-parallel (DDP) local training;
- ``options``: the options of the silo's processes (argparse only, no torch).
"""
