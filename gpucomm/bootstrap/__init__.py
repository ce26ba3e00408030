"""Bootstrap: who am I (``world``), how the ranks meet (``rendezvous``, ``meeting``), and which GPU
this rank takes (``devices``). Nothing here knows about collectives."""
