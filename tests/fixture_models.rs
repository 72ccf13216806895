//! The tiny-model generator writes loadable, self-consistent models for every
//! architecture: MLX reads the weights, `tokenizers` reads the tokenizer, and
//! the same spec always produces the same bytes.

use std::collections::HashMap;

use mlx_rs::Array;
use mlxgate::fixtures::{Architecture, SPECIAL_TOKENS, TinyModelSpec, write_tiny_model};
use serde_json::Value;

fn read_json(path: &std::path::Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

#[test]
fn every_architecture_writes_weights_matching_its_config() {
    for architecture in Architecture::ALL {
        let dir = tempfile::tempdir().unwrap();
        write_tiny_model(dir.path(), &TinyModelSpec::new(architecture)).unwrap();
        let config = read_json(&dir.path().join("config.json"));
        let get = |key: &str| config[key].as_u64().unwrap_or_else(|| panic!("{key}")) as i32;
        let (hidden, vocab, layers) = (
            get("hidden_size"),
            get("vocab_size"),
            get("num_hidden_layers"),
        );
        let q_dim = get("num_attention_heads") * get("head_dim");
        let kv_dim = get("num_key_value_heads") * get("head_dim");
        assert_eq!(config["model_type"], architecture.model_type());

        let weights: HashMap<String, Array> =
            Array::load_safetensors(dir.path().join("model.safetensors")).unwrap();
        let shape = |name: &str| -> Vec<i32> {
            weights
                .get(name)
                .unwrap_or_else(|| panic!("{architecture:?}: {name} missing"))
                .shape()
                .to_vec()
        };
        assert_eq!(shape("model.embed_tokens.weight"), vec![vocab, hidden]);
        for layer in 0..layers {
            let p = format!("model.layers.{layer}");
            assert_eq!(
                shape(&format!("{p}.self_attn.q_proj.weight")),
                vec![q_dim, hidden]
            );
            assert_eq!(
                shape(&format!("{p}.self_attn.k_proj.weight")),
                vec![kv_dim, hidden]
            );
            assert_eq!(
                shape(&format!("{p}.self_attn.o_proj.weight")),
                vec![hidden, q_dim]
            );
            assert_eq!(shape(&format!("{p}.input_layernorm.weight")), vec![hidden]);
        }
        let has = |suffix: &str| weights.keys().any(|k| k.ends_with(suffix));
        assert_eq!(
            has("q_proj.bias"),
            architecture == Architecture::Qwen2,
            "{architecture:?}"
        );
        assert_eq!(
            has("q_norm.weight"),
            matches!(architecture, Architecture::Qwen3 | Architecture::Gemma3),
            "{architecture:?}"
        );
        assert_eq!(
            has("pre_feedforward_layernorm.weight"),
            architecture == Architecture::Gemma3
        );
    }
}

#[test]
fn tokenizer_round_trips_text_and_keeps_special_tokens_whole() {
    let dir = tempfile::tempdir().unwrap();
    write_tiny_model(dir.path(), &TinyModelSpec::new(Architecture::Llama)).unwrap();
    let tokenizer = tokenizers::Tokenizer::from_file(dir.path().join("tokenizer.json")).unwrap();

    let text = "in the weather of Paris, 23°C — héllo!";
    let encoding = tokenizer.encode(text, false).unwrap();
    assert_eq!(tokenizer.decode(encoding.get_ids(), false).unwrap(), text);
    // Merges apply: " the" is one token, fewer tokens than bytes overall.
    assert!(
        encoding.get_tokens().iter().any(|t| t == "Ġthe"),
        "{:?}",
        encoding.get_tokens()
    );
    assert!(encoding.len() < text.len());

    let chat = tokenizer
        .encode("<|im_start|>user\nhi<|im_end|>", false)
        .unwrap();
    assert_eq!(chat.get_ids()[0], 1);
    assert_eq!(*chat.get_ids().last().unwrap(), 2);
    for (id, token) in SPECIAL_TOKENS.iter().enumerate() {
        assert_eq!(tokenizer.token_to_id(token), Some(id as u32));
    }
    let config = read_json(&dir.path().join("tokenizer_config.json"));
    assert!(
        config["chat_template"]
            .as_str()
            .unwrap()
            .contains("add_generation_prompt")
    );
}

#[test]
fn the_same_spec_writes_the_same_bytes_and_seeds_change_them() {
    let spec = TinyModelSpec::new(Architecture::Gemma3);
    let (a, b, c) = (
        tempfile::tempdir().unwrap(),
        tempfile::tempdir().unwrap(),
        tempfile::tempdir().unwrap(),
    );
    write_tiny_model(a.path(), &spec).unwrap();
    write_tiny_model(b.path(), &spec).unwrap();
    write_tiny_model(c.path(), &TinyModelSpec { seed: 8, ..spec }).unwrap();
    let read =
        |dir: &tempfile::TempDir| std::fs::read(dir.path().join("model.safetensors")).unwrap();
    assert_eq!(read(&a), read(&b));
    assert_ne!(read(&a), read(&c));
}
