# The image of every role of a wuliang job (parameter servers, chief,
# workers, serving): deploy/k8s/tfjob.yaml runs it.
#
#   docker build -t REGISTRY/wuliang:latest .
#
# Two stages. The first compiles wuliang's wheel (g++ and the sources stay
# there); the second installs only that wheel with the tf and serving
# extras. Both install under deploy/constraints.txt (tools/pin_image.py),
# the exact versions of every package, which the image keeps in
# /etc/wuliang. The C++ core is built portable (no -march=native: the pods'
# machines may differ).
ARG PYTHON=python:3.11-slim

FROM ${PYTHON} AS build
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/*
ENV PIP_CONSTRAINT=/src/deploy/constraints.txt PIP_NO_CACHE_DIR=1
WORKDIR /src
COPY . /src
RUN pip wheel --no-deps --wheel-dir /wheels . \
        --config-settings=cmake.define.WULIANG_NATIVE=OFF

FROM ${PYTHON}
COPY deploy/constraints.txt /etc/wuliang/constraints.txt
ENV PIP_CONSTRAINT=/etc/wuliang/constraints.txt PIP_NO_CACHE_DIR=1
COPY --from=build /wheels /wheels
RUN pip install "$(ls /wheels/wuliang-*.whl)[tf,serving]" && rm -rf /wheels
LABEL org.opencontainers.image.description="wuliang: parameter servers, trainers and serving" \
      wuliang.constraints=/etc/wuliang/constraints.txt

# wuliang ps listens on 2222 (TF_CONFIG's port); wuliang serve on 8500/8501
EXPOSE 2222 8500 8501
CMD ["wuliang", "--help"]
