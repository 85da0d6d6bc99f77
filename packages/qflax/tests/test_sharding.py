"""PTQ of partitioned models on a simulated 8-device CPU mesh keeps logical axes and shardings."""

from qcore import testing

LINEN = """
import flax.linen as nn, jax, jax.numpy as jnp, numpy as np
import qflax
from jax.sharding import PartitionSpec as P

mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
init = nn.initializers.lecun_normal()

class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.Dense(256, kernel_init=nn.with_logical_partitioning(init, ("embed", "mlp")))(x)
        return nn.Dense(64, kernel_init=nn.with_logical_partitioning(init, ("mlp", "embed")))(x)

x = jax.random.normal(jax.random.key(1), (8, 128))
rules = [qflax.QuantizationRule(weight_qtype="int4", tile_size=32, act_qtype="int8")]
qmodel = qflax.quantize_model(Net(), qflax.PtqProvider(rules))
abstract = jax.eval_shape(qmodel.init, jax.random.key(0), x)
specs = nn.get_partition_spec(abstract)
kernel_specs = jax.tree.leaves(specs["params"]["Dense_0"]["kernel"])
# Codes, then scales: the tiled axis 0 has 128 / 32 = 4 scales and keeps its name, as in Qwix.
assert kernel_specs == [P("embed", "mlp"), P("embed", "mlp")], kernel_specs
logical = [("embed", "data"), ("mlp", "model")]
shardings = nn.logical_to_mesh_sharding(specs, mesh, logical)
with jax.set_mesh(mesh), nn.logical_axis_rules(logical):
    variables = jax.jit(qmodel.init, out_shardings=shardings)(jax.random.key(0), x)
    kernel = variables["params"]["Dense_0"]["kernel"]
    assert kernel.qarray.qvalue.names == ("embed", "mlp")
    assert kernel.qarray.qvalue.value.sharding.spec == P("data", "model")
    assert kernel.qarray.scale.value.sharding.spec == P("data", "model")
    y = jax.jit(qmodel.apply)(variables, x)
# The same params quantized model-free, then placed with the same shardings.
fp = nn.unbox(Net().init(jax.random.key(0), x)["params"])
params = qflax.quantize_params(fp, abstract["params"])
params = jax.device_put(params, nn.logical_to_mesh_sharding(specs["params"], mesh, logical))
assert params["Dense_0"]["kernel"].qarray.qvalue.sharding.spec == P("data", "model")
with nn.logical_axis_rules(logical):
    single = qmodel.apply(jax.device_get(nn.unbox(variables)), x)
# Sharded contractions sum in another order: equal up to float32 rounding.
np.testing.assert_allclose(np.asarray(y), np.asarray(single), rtol=1e-5, atol=1e-6)
print("ok")
"""

NNX = """
import jax, jax.numpy as jnp, numpy as np
from flax import nnx
import qflax
from jax.sharding import PartitionSpec as P

mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
init = nnx.initializers.lecun_normal()
a_init = nnx.with_partitioning(init, ("data", "model"))
b_init = nnx.with_partitioning(init, ("model", None))

class Net(nnx.Module):
    def __init__(self, rngs):
        self.a = nnx.Linear(128, 256, kernel_init=a_init, rngs=rngs)
        self.b = nnx.Linear(256, 64, kernel_init=b_init, rngs=rngs)

    def __call__(self, x):
        return self.b(self.a(x))

x = jax.random.normal(jax.random.key(1), (8, 128))
with jax.set_mesh(mesh):
    model = Net(nnx.Rngs(0))
    ref = model(x)
    rules = [qflax.QuantizationRule(weight_qtype="int8", act_qtype="int8")]
    qmodel = qflax.quantize_model(model, qflax.PtqProvider(rules), x)
    qa = qmodel.a.kernel.get_raw_value().qarray
    assert qa.qvalue.sharding.spec == P("data", "model"), qa.qvalue.sharding
    assert qa.scale.sharding.spec == P(None, "model"), qa.scale.sharding
    y = nnx.jit(lambda m, x: m(x))(qmodel, x)
err = float(jnp.linalg.norm(y - ref) / jnp.linalg.norm(ref))
assert 0 < err < 0.02, err
print("ok")
"""

NNX_TILED = """
import jax, jax.numpy as jnp, numpy as np
from flax import nnx
import qflax
from jax.sharding import PartitionSpec as P

mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
init = nnx.initializers.lecun_normal()
a_init = nnx.with_partitioning(init, ("data", "model"))
b_init = nnx.with_partitioning(init, ("model", None))

class Net(nnx.Module):
    def __init__(self, rngs):
        self.a = nnx.Linear(128, 256, kernel_init=a_init, rngs=rngs)
        self.b = nnx.Linear(256, 64, kernel_init=b_init, rngs=rngs)

    def __call__(self, x):
        return self.b(self.a(x))

x = jax.random.normal(jax.random.key(1), (8, 128))
rules = [
    qflax.QuantizationRule(module_path="a", weight_qtype="int4", tile_size=32),
    qflax.QuantizationRule(module_path="b", weight_qtype="int4", tile_size=128),
]
with jax.set_mesh(mesh):
    model = Net(nnx.Rngs(0))
    ref = model(x)
    qmodel = qflax.quantize_model(model, qflax.PtqProvider(rules), x)
    a = qmodel.a.kernel.get_raw_value().qarray
    # 128 / 32 = 4 tiles on 'data' (2 devices): the tiled scale axis stays sharded.
    assert a.scale.shape == (4, 256), a.scale.shape
    assert a.scale.sharding.spec == P("data", "model"), a.scale.sharding
    b = qmodel.b.kernel.get_raw_value().qarray
    # 256 / 128 = 2 tiles cannot be split over 'model' (4 devices): that axis is replicated.
    assert b.scale.shape == (2, 64), b.scale.shape
    assert b.scale.sharding.spec == P(None, None), b.scale.sharding
    y = nnx.jit(lambda m, x: m(x))(qmodel, x)
    eager = jax.device_get(qmodel(x))
np.testing.assert_allclose(np.asarray(y), eager, rtol=1e-5, atol=1e-5)
err = float(jnp.linalg.norm(y - ref) / jnp.linalg.norm(ref))
assert 0 < err < 0.2, err
print("ok")
"""


def test_linen_partitioned_params_keep_logical_axes_and_shardings():
    assert testing.run_on_cpu_devices(LINEN, 8).strip() == "ok"


def test_nnx_sharded_params_keep_their_named_shardings():
    assert testing.run_on_cpu_devices(NNX, 8).strip() == "ok"


def test_nnx_tiled_scales_keep_the_tiled_axis_sharding_where_the_tiles_divide():
    assert testing.run_on_cpu_devices(NNX_TILED, 8).strip() == "ok"
