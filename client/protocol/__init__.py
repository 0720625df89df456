"""The message contract between fedring's ServerApp and ClientApp.

What crosses the wire, in one leaf package both sides import (as Flower keeps
``secaggplus_constants``): it imports Flower's public ``flwr.app``, numpy, ``aggregation``
and ``privacy``, never torch or the rest of ``client``; Flower's internals only through
``flower_compat``.

- ``keys``: record names and the keys of the train config, metrics and node config;
- ``train``: the config a train message carries with the model;
- ``npy``: Flower Arrays in .npy format (and in-process reply buffers);
- ``updates``: models and deltas in messages;
- ``compression``: the compressed-upload request;
- ``secagg``: secure-aggregation framing, settings and stage names;
- ``ring``: the cross-silo ring's spec, records and digest;
- ``flower_compat``: every use of a Flower private name or internal module, each checked
  by a test against the pinned Flower.
"""
