"""The control plane: what ranks must agree on (``negotiation``), rank 0's bookkeeping
(``coordinator``), each rank's side (``controller``; ``local`` in a one-rank job), the
authenticated links (``channel``) and the stall inspector. Used only for ad-hoc collectives and
for agreeing on a fixed schedule once; it builds on ``gpucomm.dataplane``."""
