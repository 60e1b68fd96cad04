"""What a model family is: the `Family` record, every fact about a family that minimoe reads outside the modules
themselves; the registry of them (`FAMILIES`, `register_family`, `family_of`); the config.json fields every family
shares. The records themselves are in families.py and families_2026*.py.

A family is its config.json `model_type`. The record says how its config.json maps onto `MoEConfig`
(renamed fields, fields it lacks, values it fixes, transformers' defaults for fields it may omit),
how its checkpoint names and stores our parameters (`layer_keys`, with a `Converted` entry naming the layout
of a tensor stored otherwise than ours: loading/layouts.py converts it), how config.json gets a field we leave None
(`write_defaults`), what LoRA adapts by default and where (`lora_targets`, `lora_paths`), which of
runs/recipes.py's `RECIPES` trains it, and where to find real checkpoints. The modules read only
config fields (qk_norm, scoring, biases, ...), never the family's name, so that a family is
added in one record (families.py, families_2026*.py), plus a module in a room of core/ only where it brings a new kind of computation.
"Our field" below is a flat name: a `MoEConfig` field, or an option of a token mixer's own config
(core/token_mixers/mixers.py: `mamba_*`, `linear_*`, MLA's ranks, attention's options), which `MoEConfig.from_flat` hands to it.

Decisions:
- The recipe is named, not held: recipes are run settings (runs/, which core may not import), and
  the paper gives two, Granite's and OLMoE's. A family the paper did not train names the recipe of
  the nearer scoring rule (softmax over all experts: OLMoE's; top-K on logits: Granite's), and says
  so in `recipe_note`; `--recipe` overrides it. LoRA's targets come from the family, not the recipe: a
  recipe holds no family's facts, so one recipe trains every family that names it (the hybrids too).
- config.json is written as the family's transformers config writes it: the fields every family has
  (`CONFIG_FIELDS`) and the family's own (`config_fields`); our other fields keep their defaults.
- `fixed` values are not read from config.json and not written back: they are what the family's
  modeling file hard-codes (OLMoE's q/k norm over the full projection width, Granite's top-K on
  logits), stated as our config fields so that every module reads fields only.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Family:
    model_type: str  # config.json's model_type
    architecture: str  # config.json's "architectures" entry, written back on save
    brings: str  # what the family adds to the others, one line (the README's family table)
    hub_examples: tuple[str, ...]  # real checkpoints of the family on the Hugging Face hub
    recipe: str  # the runs.recipes.RECIPES preset that trains it (module docstring)
    lora_targets: tuple[str, ...]  # lora.TARGETS names (and ALIASES) adapted when --lora-targets is not given
    # our parameter name (per layer) -> its on-disk key, or a tuple of per-expert key patterns ({j}:
    # the expert) concatenated along `out` into our stacked bank (gate rows, then up rows), or a
    # `Converted` key (stored in another layout than ours)
    layer_keys: dict = field(default_factory=dict)
    renames: dict = field(default_factory=dict)  # config.json field -> our field (module docstring: a flat name)
    config_fields: frozenset = frozenset()  # our fields its config.json has beyond CONFIG_FIELDS (written back)
    fixed: dict = field(default_factory=dict)  # our fields the family hard-codes (not read, not written)
    # transformers' config defaults for fields config.json may omit (tests/core/decoder/test_family_defaults.py holds them
    # to transformers' config classes); a callable takes config.json's fields, for a default that depends on them
    defaults: dict = field(default_factory=dict)
    name_hints: tuple[str, ...] = ()  # lowercase parts of a hub id or folder name that mean this family (sweep.py)
    recipe_note: str = ""  # why it trains with `recipe` where the paper gives it none
    never_null: frozenset = frozenset()  # our fields its transformers config cannot read as null: not written when None
    # config.json's per-layer kind (its `layer_types` values) -> our core/token_mixers/mixers.py MIXERS name, for the
    # hybrids, whose layer_types name each layer's token mixer (read into `mixer_types`, written back)
    layer_kinds: dict = field(default_factory=dict)
    ignored_prefixes: tuple[str, ...] = ()  # on-disk keys we do not load (transformers ignores them too)
    # on-disk key prefix -> ours, for a layout of the hub's files beside the one we write (Qwen3.5's vision-language
    # release nests the text model under model.language_model.; transformers' conversion mapping reads both)
    key_prefixes: dict = field(default_factory=dict)
    # a layer's on-disk expert bank [E, out, in] stored fused -> the per-expert keys of layer_keys it holds (its out
    # rows split evenly among them, in order): the hub's layout beside the per-expert one we write (loading/layouts.py)
    fused_banks: dict = field(default_factory=dict)
    # a layer's on-disk key in another layout the family's files come in -> the layer_keys key it holds (Kimi Linear:
    # transformers 5.23 saves a dense layer's MLP under block_sparse_moe., the release under mlp.): read as that key
    key_aliases: dict = field(default_factory=dict)
    # config.json's model_type for the text model where the family is named after a multimodal release (Qwen3.5's
    # text config class writes "qwen3_5_moe_text"): read as this family, and written back; the release's own
    # config.json nests it under text_config (loading/config_json.py reads that)
    text_model_type: str | None = None
    # our field left None -> a callable of the MoEConfig giving what config.json gets instead, where the family's
    # transformers config would fill in another value than the one our model runs with
    write_defaults: dict = field(default_factory=dict)
    # a lora.TARGETS name -> the modules it adapts in this family's layers instead of TARGETS's: the first
    # of them a layer has (DeepSeek's MLA: `MLA_LORA_PATHS`)
    lora_paths: dict = field(default_factory=dict)
    packed_release: str | None = None  # the packed format of its released experts ("mxfp4": --quantize mxfp4)
    # whether transformers trains it with its config's router_aux_loss_coef (output_router_logits=True): what
    # --aux-coef family reads; Llama 4's config.json carries one that its modeling file never applies
    applies_aux_loss: bool = True
    # config.json keys no field of ours reads, with the one value our model runs with (a callable takes config.json's
    # fields): another value is refused by name (loading/config_keys.py, which holds the ones every family shares)
    unread: dict = field(default_factory=dict)
    # config.json keys of its transformers config that change nothing it computes, dropped on read where one is also
    # our field's name (MLA's head_dim, which transformers writes as qk_rope_head_dim; ours is not that)
    harmless: frozenset = frozenset()
    # where its checkpoint names our modules outside `layer_keys`: the layers' prefix for our `model.layers.`,
    # and our other parameters' keys (Nemotron-H: backbone.layers., backbone.embeddings, backbone.norm_f; LFM2's final norm, model.embedding_norm)
    layers_prefix: str = "model.layers."
    outer_keys: dict = field(default_factory=dict)
    # unread keys whose transformers default is not the value our model runs with: that default, so that a config.json
    # leaving one out is refused as one setting it would be (Gemma 4's enable_moe_block, false: the dense model)
    unread_defaults: dict = field(default_factory=dict)
    # model_types of the multimodal config.json that hold this family's as their text_config (the released Qwen3.5s,
    # Gemma 4s and Mistral Small 4; their tensors' prefix: key_prefixes): read as this family's model
    # (loading/config_json.py); each -> the model_type its transformers config gives a text_config that names none
    # (Mistral3Config's: "mistral", the dense Mistral, refused as not ours)
    containers: dict = field(default_factory=dict)
    # our fields whose null in config.json means the default, as the family's transformers config reads it (MiMo's
    # released config.json writes routed_scaling_factor null: 1.0)
    null_defaults: frozenset = frozenset()
    # the oldest transformers major version that holds the family: its tests' oracle (tests/conftest.py's
    # TRANSFORMERS_5_ONLY) and the one export_peft writes for by default (integrations/hf_export.py)
    since_transformers: int = 4
    # within a layer, a checkpoint path prefix -> transformers 5's module path, where its conversion mapping renames
    # the module on load (Mixtral's block_sparse_moe. -> mlp.): where the peft export for transformers 5 names it
    modules_in_5: dict = field(default_factory=dict)
    experts_transposed_in_5: bool = False  # transformers 5's experts module says `is_transposed` ([E, in, out]), read by peft
    peft_refuses_mamba_out: bool = False  # peft 0.21 refuses LoRA on its Mamba out_proj (peft's check, by model_type)


@dataclass(frozen=True)
class Converted:
    """An on-disk tensor stored in another layout than our parameter's: `layout` names the conversion
    (loading/layouts.py's `LAYOUTS`: "gate_up_interleaved", "bias_interleaved", "transposed")."""
    key: str
    layout: str


FAMILIES: dict[str, Family] = {}
TEXT_MODEL_TYPES: dict[str, str] = {}  # a family's text_model_type -> its model_type


def register_family(family: Family) -> Family:
    """Add a family to `FAMILIES` (a file of your own may declare one the same way)."""
    FAMILIES[family.model_type] = family
    if family.text_model_type:
        TEXT_MODEL_TYPES[family.text_model_type] = family.model_type
    return family


def family_of(model_type: str, source: str = "config") -> Family:
    """The record of `model_type` (or of its text_model_type); an unknown one is an error naming the families."""
    family = FAMILIES.get(TEXT_MODEL_TYPES.get(model_type, model_type))
    if family is None:
        raise ValueError(f"{source}: unknown model_type {model_type!r}; expected one of {sorted(FAMILIES)}")
    return family


# Every record must give these a value (tests/core/decoder/test_families.py holds each record complete).
REQUIRED = ("model_type", "architecture", "brings", "hub_examples", "recipe", "lora_targets")

# Our MoEConfig fields that every family's config.json holds (under its own name: `renames`).
CONFIG_FIELDS = frozenset({
    "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "num_experts", "num_experts_per_tok", "rms_norm_eps", "rope_theta",
    "max_position_embeddings", "tie_word_embeddings", "pad_token_id", "bos_token_id", "eos_token_id",
    "initializer_range", "hidden_act", "rope_scaling", "torch_dtype"})
