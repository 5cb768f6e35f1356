"""The SSD metric families both servers export, named and described once: the Triton `ssd`
model's custom metrics and a Dynamo worker's `/metrics` carry the same families, so one
dashboard reads either server. Counter names here lack the `ssd_` prefix and the `_total`
suffix, which each server's metrics library writes its own way."""
from __future__ import annotations

# Tokens per second of one request; a tiny model on CPU reaches the thousands.
TOKENS_PER_S_BUCKETS = (1, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000)
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64)

# summed over finished requests (K per round: verified_draft_tokens over rounds)
GENERATION_COUNTERS = {
    "generated_tokens": "Tokens generated",
    "rounds": "Decoding rounds (one target verification each)",
    "accepted_draft_tokens": "Draft tokens the target accepted",
    "verified_draft_tokens": "Draft tokens the target verified",
    "cache_hits": "Rounds whose outcome was pre-speculated (SSD cache hits)",
    "cache_misses": "Rounds whose outcome was not pre-speculated",
}
REQUESTS_HELP = "Requests by finish reason"
IN_FLIGHT_HELP = "Generations running or waiting for a KV slot"
QUEUED_HELP = "Requests waiting for a KV slot"
TOKENS_PER_S_HELP = "Generated tokens per second of each request"
BATCH_SIZE_HELP = "Requests in each decoding round"
UNDRAFTED_HELP = "Decoding rounds that drafted nothing, by why"
ALONE_ROUNDS_HELP = ("Decoding rounds the target verified alone: nothing of the draft's beside it, "
                     "on its wide session (all its threads) where it has one")


def generation_figures(output_tokens: int, stats: dict) -> dict[str, int]:
    """A finished generation's contribution to each of `GENERATION_COUNTERS`."""
    return {"generated_tokens": output_tokens, "rounds": stats["rounds"],
            "accepted_draft_tokens": sum(a * n for a, n in enumerate(stats["accepted_histogram"])),
            "verified_draft_tokens": stats["drafted_tokens"],
            "cache_hits": stats["cache_hits"], "cache_misses": stats["cache_misses"]}
