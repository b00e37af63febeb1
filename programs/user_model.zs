# user_model.zs: train your own PyTorch model.
#
# The model is built by calling build(**kwargs) in my_model.py (next to this
# file); any nn.Module that offers `units()` (see programs/my_model.py) can
# be sharded and offloaded like the built-in GPT.

schedule user_model "a user's own model (programs/my_model.py), ZeRO-3"
model     "my_model.py:build"(vocab=256, context=32, hidden=64, layers=2)
data      corpus("stdlib", context=32)   # the model's context must be at least this
train     steps=20, batch=4, precision=fp32
optimizer adamw(lr=3e-3)
ranks     2 on cpu
zero      3
