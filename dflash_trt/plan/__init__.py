"""Planning: the layouts a target fits, the speed model (one cost model), the draft length per concurrency, the plot."""
