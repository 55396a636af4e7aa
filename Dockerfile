# The image of every role of a wuliang job (parameter servers, chief,
# workers, serving): deploy/k8s/tfjob.yaml runs it. The C++ core is built
# portable (no -march=native: the pods' machines may differ).
#
#   docker build -t REGISTRY/wuliang:latest .
FROM python:3.11-slim

RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ make \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /app
COPY . /app
RUN pip install --no-cache-dir '.[tf,serving]' \
        --config-settings=cmake.define.WULIANG_NATIVE=OFF

# wuliang ps listens on 2222 (TF_CONFIG's port); wuliang serve on 8500/8501
EXPOSE 2222 8500 8501
CMD ["wuliang", "--help"]
