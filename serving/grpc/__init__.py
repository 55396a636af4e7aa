"""The gRPC transport of ``wuliang serve``.

Modules:

* ``server``: ``GrpcServer``, wuliang's own ``Serving`` service, TensorFlow
  Serving's (``wuliang.serving.tfs.grpc``) and the health service on one
  port, with the shedding pools of ``wuliang.serving.overload``;
* ``common``: what both gRPC services share (tokens, parsing inside the
  handler, errors as statuses with a shed call's retry pushback);
* ``proto``: the messages of ``serving.proto`` (beside it), the contract
  for clients in any language.
"""
