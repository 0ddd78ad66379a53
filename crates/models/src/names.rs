//! Tensor names: GGUF (llama.cpp's) and Hugging Face, as one pure table per family.
//!
//! Families bind by the GGUF role name (`attn_q`, `ffn_norm` …); [`Naming::layer`] turns a
//! role into the file's name. The HF side differs per family only in its norms (gemma's sandwich
//! norms reuse names llama gives to other norms), so each family passes its own norm table.

/// Which naming a file's tensors follow.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Naming {
    Gguf,
    Hf,
}

/// HF names of the dense-family roles every family shares.
const HF_COMMON: &[(&str, &str)] = &[
    ("attn_norm", "input_layernorm"),
    ("attn_q", "self_attn.q_proj"),
    ("attn_k", "self_attn.k_proj"),
    ("attn_v", "self_attn.v_proj"),
    ("attn_output", "self_attn.o_proj"),
    ("ffn_gate", "mlp.gate_proj"),
    ("ffn_up", "mlp.up_proj"),
    ("ffn_down", "mlp.down_proj"),
];

/// llama: the second norm sits before the FFN and HF calls it `post_attention_layernorm`.
pub const HF_LLAMA: &[(&str, &str)] = &[("ffn_norm", "post_attention_layernorm")];

/// gemma3: q/k norms and sandwich norms around attention and the FFN.
pub const HF_GEMMA3: &[(&str, &str)] = &[
    ("attn_q_norm", "self_attn.q_norm"),
    ("attn_k_norm", "self_attn.k_norm"),
    ("post_attention_norm", "post_attention_layernorm"),
    ("ffn_norm", "pre_feedforward_layernorm"),
    ("post_ffw_norm", "post_feedforward_layernorm"),
];

impl Naming {
    /// The name of a whole-model tensor: `embd`, `norm` or `out`.
    pub fn global(self, role: &str) -> &'static str {
        match (self, role) {
            (Naming::Gguf, "embd") => "token_embd.weight",
            (Naming::Gguf, "norm") => "output_norm.weight",
            (Naming::Gguf, "out") => "output.weight",
            (Naming::Hf, "embd") => "model.embed_tokens.weight",
            (Naming::Hf, "norm") => "model.norm.weight",
            (Naming::Hf, "out") => "lm_head.weight",
            _ => unreachable!("unknown global tensor role {role}"),
        }
    }

    /// The name of layer `l`'s tensor for GGUF role `role`; `family` is the family's extra HF
    /// table ([`HF_LLAMA`], [`HF_GEMMA3`]). Roles are compile-time constants of the family code, so
    /// an unknown one is a programming error.
    pub fn layer(self, l: usize, role: &str, family: &[(&str, &str)]) -> String {
        match self {
            Naming::Gguf => format!("blk.{l}.{role}.weight"),
            Naming::Hf => {
                let hf = family
                    .iter()
                    .chain(HF_COMMON)
                    .find(|(r, _)| *r == role)
                    .map(|(_, h)| *h)
                    .unwrap_or_else(|| unreachable!("role {role} has no HF name"));
                format!("model.layers.{l}.{hf}.weight")
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tables() {
        assert_eq!(Naming::Gguf.layer(3, "attn_q", HF_LLAMA), "blk.3.attn_q.weight");
        assert_eq!(Naming::Hf.layer(3, "attn_q", HF_LLAMA), "model.layers.3.self_attn.q_proj.weight");
        assert_eq!(Naming::Hf.layer(0, "ffn_norm", HF_LLAMA), "model.layers.0.post_attention_layernorm.weight");
        assert_eq!(Naming::Hf.layer(0, "ffn_norm", HF_GEMMA3), "model.layers.0.pre_feedforward_layernorm.weight");
        assert_eq!(Naming::Hf.layer(1, "post_attention_norm", HF_GEMMA3), "model.layers.1.post_attention_layernorm.weight");
        assert_eq!(Naming::Hf.global("out"), "lm_head.weight");
        // Within a family, no two roles share an HF name.
        for fam in [HF_LLAMA, HF_GEMMA3] {
            let roles: Vec<&str> = fam.iter().chain(HF_COMMON).map(|(r, _)| *r).collect();
            let mut hf: Vec<String> = roles.iter().map(|r| Naming::Hf.layer(0, r, fam)).collect();
            hf.sort();
            hf.dedup();
            assert_eq!(hf.len(), roles.len());
        }
    }
}
