"""KV and recurrent caches. The cache kinds are named here, free of torch, so the CLI can offer them cheaply."""

KV_CACHE_KINDS = ("dense", "turboquant4")
