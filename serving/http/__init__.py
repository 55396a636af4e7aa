"""The HTTP/JSON transport of ``wuliang serve``, shaped like TensorFlow
Serving's REST API.

Modules:

* ``server``: ``HttpServer``, one aiohttp application on its own event
  loop, lookups answered on the loop and predictions in a pool;
* ``codec``: request bodies to feature arrays and keys, type-checked value
  by value, and answers to JSON.
"""
