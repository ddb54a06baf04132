"""Native fp8 checkpoints: a tiny model's linear weights quantised to float8_e4m3fn with
block scales (``<name>_scale_inv`` + quantization_config, the DeepSeek-V3 layout) run in
colibri without conversion and match transformers running the dequantised float32 weights."""

import json

import colibri_core
from colibri_core.testing.fp8 import fp8_rewrite
from colibri_core.testing.oracle import FamilyOracleSuite, OracleCase, random_correction_bias

from ds_configs import v3, v32

BIAS = random_correction_bias()


class TestDeepseekFp8Oracle(FamilyOracleSuite):
    model_class = "DeepseekV3ForCausalLM"
    cases = {
        # 128x128 blocks on matrices up to 160 wide: full and partial blocks
        "b128": OracleCase(v3(hidden_size=160, intermediate_size=136, moe_intermediate_size=64, q_lora_rank=48,
                              kv_lora_rank=32), prepare=BIAS, rewrite=fp8_rewrite((128, 128))),
        # 16x32 blocks (quantization_config's weight_block_size), sharded
        "b16x32_sharded": OracleCase(v3(q_lora_rank=None, moe_intermediate_size=24), seed=1, prepare=BIAS,
                                     max_shard_size="40KB", rewrite=fp8_rewrite((16, 32))),
    }

    def test_checkpoint_is_fp8(self, case_name, tmp_path_factory):
        fx = self._fixture(case_name, tmp_path_factory)
        config = json.loads((fx.path / "config.json").read_text())
        assert config["quantization_config"]["quant_method"] == "fp8"
        with colibri_core.load(fx.path) as model:
            tensors = model.checkpoint.tensors
            fp8 = [n for n, t in tensors.items() if t.dtype == "F8_E4M3"]
            assert any(".experts." in n for n in fp8) and any("kv_b_proj" in n for n in fp8)
            assert all(n + "_scale_inv" in tensors and tensors[n + "_scale_inv"].dtype == "F32" for n in fp8)


class TestDeepseekV32Fp8Oracle(FamilyOracleSuite):
    model_class = "DeepseekV32ForCausalLM"
    cases = {
        # the indexer's wq_b and wk are fp8 too (as in DeepSeek-V3.2's checkpoint)
        "b32": OracleCase(v32(index_topk=6), seed=2, prepare=BIAS, rewrite=fp8_rewrite((32, 32))),
    }
