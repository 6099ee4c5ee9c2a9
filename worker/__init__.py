"""Carpool's worker, in three wings: `engine` (scheduling, the forward pass, sampling), `model`
(the Hugging Face side: loading, routing, attention and fused layers) and `jobs` (the only
Redis/RQ code: claim, lease, publish). `python -m worker` composes them; `rq_entry` is the
function RQ records on every job."""
