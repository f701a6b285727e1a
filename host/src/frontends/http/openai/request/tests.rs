use serde_json::json;

use super::*;
use crate::{proto::inference::ModelInput, tensor::bytes_elements};

fn config() -> ModelConfig {
    let input = |name: &str| ModelInput {
        name: name.into(),
        ..Default::default()
    };
    ModelConfig {
        input: [
            "messages",
            "text_input",
            "max_tokens",
            "temperature",
            "stop",
            "stream",
        ]
        .into_iter()
        .map(input)
        .collect(),
        ..Default::default()
    }
}

fn refusal(kind: Kind, body: Value) -> (Option<String>, String) {
    match parse(kind, body.to_string().as_bytes(), |_| Ok(config())) {
        Ok(_) => panic!("accepted {body}"),
        Err(e) => (e.param, e.error.message),
    }
}

#[test]
fn a_chat_becomes_the_models_inputs() {
    let body = json!({"model": "m", "messages": [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hi"}], "name": "ann"}],
        "max_tokens": 3, "stop": "x", "top_p": 0.5});
    let parsed = parse(Kind::Chat, body.to_string().as_bytes(), |_| Ok(config()))
        .unwrap()
        .1;
    let names: Vec<_> = parsed
        .request
        .inputs
        .iter()
        .map(|t| t.name.as_str())
        .collect();
    // top_p is not an input of this model, so it is left out.
    assert_eq!(
        names,
        ["messages", "max_tokens", "temperature", "stop", "stream"]
    );
    let chat = bytes_elements(&parsed.request.inputs[0].data)
        .next()
        .unwrap();
    assert_eq!(
        serde_json::from_slice::<Value>(chat).unwrap(),
        json!([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    );
    assert!(!parsed.stream);
}

#[test]
fn a_wrong_type_is_refused_naming_its_field() {
    let (param, message) = refusal(
        Kind::Chat,
        json!({"model": "m", "messages": [
        {"role": "user", "content": "hi"}], "temperature": "hot"}),
    );
    assert_eq!(param.as_deref(), Some("temperature"));
    assert!(
        message.starts_with("'temperature': invalid type"),
        "{message}"
    );
    let (param, message) = refusal(
        Kind::Chat,
        json!({"model": "m", "messages": [
        {"role": "robot", "content": "hi"}]}),
    );
    assert_eq!(param.as_deref(), Some("messages"));
    assert!(message.contains("messages[0].role"), "{message}");
}

#[test]
fn fields_of_the_other_endpoint_are_unrecognized() {
    let (param, message) = refusal(Kind::Chat, json!({"model": "m", "prompt": "hi"}));
    assert_eq!(param.as_deref(), Some("prompt"));
    assert_eq!(message, "Unrecognized request argument supplied: prompt");
    let (param, _) = refusal(Kind::Completion, json!({"model": "m", "messages": []}));
    assert_eq!(param.as_deref(), Some("messages"));
}

#[test]
fn prompts_and_stops_of_unserved_shapes_are_refused() {
    let many: Vec<String> = (0..=prompts::MAX_PROMPTS)
        .map(|i| format!("p{i}"))
        .collect();
    for (prompt, says) in [
        (
            json!([1, 2]),
            "does not take token-id prompts (input 'prompt_ids')",
        ),
        (
            json!([[1, 2]]),
            "does not take token-id prompts (input 'prompt_ids')",
        ),
        (json!([[1, 2], []]), "'prompt' item 1 is empty"),
        (
            json!([[1, 2], "a"]),
            "item 1 is \"a\", not a list of token ids",
        ),
        (json!([1, -2]), "element 1 is -2, not a token id"),
        (json!(["a", 7]), "item 1 is 7, not a string"),
        (json!(["a", ""]), "item 1 is empty"),
        (json!([]), "lists 0 prompts"),
        (json!(many), "lists 33 prompts"),
    ] {
        let (param, message) = refusal(Kind::Completion, json!({"model": "m", "prompt": prompt}));
        assert_eq!(param.as_deref(), Some("prompt"));
        assert!(message.contains(says), "{message}");
    }
    let (param, message) = refusal(
        Kind::Completion,
        json!({"model": "m", "prompt": ["a", "b", "c", "d", "e"], "n": 16}),
    );
    assert_eq!(param.as_deref(), Some("n"));
    assert!(message.contains("80 sequences"), "{message}");
    let (param, _) = refusal(
        Kind::Completion,
        json!({"model": "m", "prompt": "p", "stop": [1]}),
    );
    assert_eq!(param.as_deref(), Some("stop"));
}

#[test]
fn each_choice_gets_a_seed_of_its_own() {
    let mut c = config();
    c.input.push(crate::proto::inference::ModelInput {
        name: "seed".into(),
        ..Default::default()
    });
    let body = json!({"model": "m", "prompt": "p", "n": 3, "seed": 40});
    let parsed = parse(Kind::Completion, body.to_string().as_bytes(), |_| {
        Ok(c.clone())
    })
    .unwrap()
    .1;
    assert_eq!(parsed.n, 3);
    let seed = |i| {
        let r = parsed.request_for(i);
        let t = r.inputs.iter().find(|t| t.name == "seed").unwrap();
        u64::from_le_bytes(t.data[..8].try_into().unwrap())
    };
    assert_eq!((seed(0), seed(1), seed(2)), (40, 41, 42));
    let (param, _) = refusal(
        Kind::Completion,
        json!({"model": "m", "prompt": "p", "n": 2, "best_of": 3}),
    );
    assert_eq!(param.as_deref(), Some("best_of"));
}

#[test]
fn listed_prompts_get_n_choices_each_in_order() {
    let mut c = config();
    c.input.push(crate::proto::inference::ModelInput {
        name: "seed".into(),
        ..Default::default()
    });
    let body = json!({"model": "m", "prompt": ["one", "two", "three"], "n": 2,
                      "seed": 7, "echo": true});
    let parsed = parse(Kind::Completion, body.to_string().as_bytes(), |_| {
        Ok(c.clone())
    })
    .unwrap()
    .1;
    assert_eq!(parsed.choices(), 6);
    let text = |i| {
        let r = parsed.request_for(i);
        let t = r.inputs.iter().find(|t| t.name == "text_input").unwrap();
        String::from_utf8(t.data[4..].to_vec()).unwrap()
    };
    let seed = |i| {
        let r = parsed.request_for(i);
        let t = r.inputs.iter().find(|t| t.name == "seed").unwrap();
        u64::from_le_bytes(t.data[..8].try_into().unwrap())
    };
    let got: Vec<_> = (0..6).map(|i| (text(i), seed(i))).collect();
    let want = [
        ("one", 7),
        ("one", 8),
        ("two", 7),
        ("two", 8),
        ("three", 7),
        ("three", 8),
    ];
    assert_eq!(got, want.map(|(t, s)| (t.to_owned(), s)));
    assert_eq!(parsed.echo_for(5), Echo::Text("three".into()));
    assert_eq!(parsed.prompt_of(3), 1);
    // Token ids go to `prompt_ids` instead, and their echo is spelled by the model.
    c.input
        .extend(["prompt_ids", "return_prompt_log_probs"].map(|name| {
            crate::proto::inference::ModelInput {
                name: name.into(),
                ..Default::default()
            }
        }));
    let body = json!({"model": "m", "prompt": [[5, 6], [7]], "echo": true});
    let parsed = parse(Kind::Completion, body.to_string().as_bytes(), |_| {
        Ok(c.clone())
    })
    .unwrap()
    .1;
    assert!(parsed.scored_prompt);
    let r = parsed.request_for(1);
    assert!(!r.inputs.iter().any(|t| t.name == "text_input"));
    let ids = r.inputs.iter().find(|t| t.name == "prompt_ids").unwrap();
    assert_eq!(
        (ids.shape.as_slice(), &ids.data[..]),
        (&[1, 1][..], &7i32.to_le_bytes()[..])
    );
    assert_eq!(parsed.echo_for(1), Echo::Spelled);
}

#[test]
fn options_that_ask_for_nothing_are_accepted() {
    let body = json!({"model": "m", "prompt": "p", "echo": false,
                      "suffix": "", "n": 1, "best_of": null});
    assert!(parse(Kind::Completion, body.to_string().as_bytes(), |_| Ok(
        config()
    ))
    .is_ok());
    let (param, _) = refusal(
        Kind::Completion,
        json!({"model": "m", "prompt": "p", "logprobs": 2}),
    );
    assert_eq!(param.as_deref(), Some("logprobs"));
    let (param, message) = refusal(
        Kind::Completion,
        json!({"model": "m", "prompt": "p", "logprobs": 2, "echo": true}),
    );
    assert_eq!(param.as_deref(), Some("echo"));
    assert!(message.contains("'return_prompt_log_probs'"), "{message}");
}
