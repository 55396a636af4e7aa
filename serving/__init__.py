"""Serving: what an online process needs to answer requests with a trained model.

The online server comes here. Today: ``wuliang.serving.versions``, the read
side of the model store (the export directories that ``wuliang.export``
writes): which versions there are, the chain of a version, and applying it
to an engine. Nothing here imports TensorFlow or the export writer.
"""
