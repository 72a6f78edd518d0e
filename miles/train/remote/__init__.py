"""Rollout engines in processes of their own: the placement of training and rollout on separate
devices (--rollout-num-gpus without --colocate).

`server` is the built-in engine as a process serving SGLang's HTTP API; `client` talks that
API to one engine (the built-in server or `sglang.launch_server`); `fleet` starts, watches and
routes requests over the engines; `group` opens the collective group weights are broadcast
over; `disk` writes and applies weight versions on disk (full or delta, checksummed);
`transfer` is the three ways a weight sync reaches the engines; `engine` is the trainer's
`RolloutEngine` over all of it.
"""
