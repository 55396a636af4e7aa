"""TensorFlow Serving's API over wuliang's served models.

A team whose clients call TensorFlow Serving (``tensorflow.serving.
PredictionService`` and ``ModelService`` over gRPC, stubs in any language)
points them at ``wuliang serve`` and changes nothing else. ``docs/serving.md``
("TensorFlow Serving's gRPC API") describes what is answered and how.

Modules:

* ``proto``: the messages, built at import from the compiled descriptors of
  ``*.proto`` beside it (written here with TensorFlow Serving's field names
  and numbers; ``make protos`` regenerates them);
* ``tensors``: ``TensorProto`` s to wuliang's feature arrays and outputs back;
* ``signature``: a served version's ``serving_default`` signature (its
  features as inputs, its tower's outputs), for both APIs' metadata;
* ``grpc``: the gRPC handlers, added to ``GrpcServer`` beside wuliang's own;
* ``config``: TensorFlow Serving's model config file (``--model-config``).
"""
