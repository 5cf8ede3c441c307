"""A Tinker-compatible training service (`baton serve MODEL_DIR`): the official `tinker` SDK drives baton's
learner and torch engine over HTTP on 127.0.0.1, unchanged.

One concern per module: `wire` (the SDK's protobuf bodies), `losses` (Tinker's built-in losses mapped onto
the learner's objectives), `training` (one client's model, LoRA or full: forward, backward, Adam step,
the weights for samplers), `sampling` (torch engines serving saved adapters and full versions), `futures`
(results retrieved by id), `service` (sessions, models, samplers: what the endpoints act on), `calls` (a model
call's work, made from its journal record), `journal` (the write-ahead journal of accepted calls and a
restart's plan), `store` (committed learner states and saved adapters on disk), `recovery` (a restart over the
state folder), `routes` (the HTTP surface and its key), `refusals` (what is refused, by name, at the first call
that names it).

It is the top layer of `stages`: it uses the learner and the engines, and nothing in `stages` imports it.
"""
