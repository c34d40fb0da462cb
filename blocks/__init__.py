"""Model blocks the teachers and the students both build from, on a floor below both (toolchain < blocks <
teachers < students < export < bench): the FCOS detector (detection.py) and the frozen-norm rule (norm.py).  A
block takes any backbone that gives it feature maps; what builds a teacher or a student stays on its own floor."""
