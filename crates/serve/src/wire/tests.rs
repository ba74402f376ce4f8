use super::*;

fn ctx() -> ParseContext<'static> {
    ParseContext {
        tokenizer: None,
        vocab_size: 100,
        context_length: 64,
    }
}

fn parse(body: &str) -> Result<ParsedGenerate, BadRequest> {
    let mut n = 0;
    parse_generate(body.as_bytes(), &ctx(), || {
        n += 1;
        format!("r{n}")
    })
}

fn err(body: &str) -> String {
    match parse(body) {
        Ok(p) => panic!("{body} was accepted: {p:?}"),
        Err(e) => e.0,
    }
}

#[test]
fn slime_request_shape() {
    let p = parse(
        r#"{"input_ids":[1,2,3],"return_logprob":true,"sampling_params":{
            "temperature":0.7,"top_p":0.9,"top_k":-1,"max_new_tokens":16,
            "stop_token_ids":[5],"skip_special_tokens":false,"no_stop_trim":true,
            "spaces_between_special_tokens":false,"custom_params":{"x":1},"sampling_seed":3}}"#,
    )
    .unwrap();
    assert!(!p.batch);
    let item = &p.items[0];
    assert_eq!(item.request.input_ids, vec![1, 2, 3]);
    assert_eq!(item.request.params.max_new_tokens, 16);
    assert_eq!(item.request.params.stop_token_ids, vec![5]);
    assert_eq!(item.request.params.seed, Some(3));
    assert!(item.return_logprob && item.no_stop_trim && !item.skip_special_tokens);
    assert_eq!(item.request.rid.as_deref(), Some("r1"));
}

#[test]
fn batch_with_per_item_params() {
    let p = parse(
        r#"{"input_ids":[[1],[2,3]],"rid":["a","b"],
            "sampling_params":[{"max_new_tokens":1},{"max_new_tokens":null}]}"#,
    )
    .unwrap();
    assert!(p.batch);
    assert_eq!(p.items.len(), 2);
    assert_eq!(p.items[0].request.params.max_new_tokens, 1);
    assert_eq!(p.items[1].request.params.max_new_tokens, 62);
    assert_eq!(p.items[1].request.rid.as_deref(), Some("b"));
}

#[test]
fn refusals_name_the_field() {
    assert!(err("{").contains("not valid JSON"));
    assert!(err("[1]").contains("JSON object"));
    assert!(err(r#"{"input_ids":[]}"#).starts_with("input_ids: empty"));
    assert!(err(r#"{"input_ids":[[1],[]]}"#).starts_with("input_ids[1]: empty"));
    assert!(err(r#"{"input_ids":[1,100]}"#).contains("input_ids[1]: token id 100 is outside"));
    assert!(err(r#"{"input_ids":[1,-1]}"#).starts_with("input_ids[1]:"));
    assert!(err(r#"{"input_ids":"x"}"#).starts_with("input_ids:"));
    assert!(
        err(r#"{"input_ids":[1],"sampling_params":{"temperature":-1}}"#)
            .starts_with("sampling_params.temperature")
    );
    assert!(
        err(r#"{"input_ids":[1],"sampling_params":{"temperature":"hot"}}"#)
            .starts_with("sampling_params.temperature")
    );
    assert!(
        err(r#"{"input_ids":[[1],[2]],"sampling_params":[{},{"top_p":0}]}"#)
            .starts_with("sampling_params[1].top_p")
    );
    assert!(err(r#"{"input_ids":[1],"sampling_params":{"n":2}}"#).starts_with("sampling_params.n"));
    let top_k = err(r#"{"input_ids":[1],"sampling_params":{"top_k":-7}}"#);
    assert!(
        top_k.starts_with("sampling_params.top_k") && top_k.contains("-7"),
        "{top_k}"
    );
    assert!(
        err(r#"{"input_ids":[1],"sampling_params":{"frequency_penalty":0.5}}"#)
            .starts_with("sampling_params.frequency_penalty")
    );
    assert!(
        err(r#"{"input_ids":[1],"sampling_params":{"max_new_tokens":-1}}"#)
            .starts_with("sampling_params.max_new_tokens")
    );
    assert!(err(r#"{"input_ids":[1],"sampling_params":{"stop":"x"}}"#)
        .starts_with("sampling_params.stop"));
    assert!(err(r#"{"input_ids":[1],"return_logprob":"yes"}"#).starts_with("return_logprob"));
    assert!(err(r#"{"text":"hi"}"#).starts_with("text:"));
    assert!(err(r#"{"text":"hi","input_ids":[1]}"#).contains("not both"));
    assert!(err(r#"{"input_ids":[[1],[2]],"rid":"one"}"#).starts_with("rid:"));
    assert!(err(r#"{"input_ids":[1],"image_data":"x"}"#).starts_with("image_data"));
    assert!(err(r#"{"input_ids":[[1],[2]],"stream":true}"#).starts_with("stream"));
    let long: Vec<String> = (0..64).map(|_| "1".to_string()).collect();
    assert!(err(&format!(r#"{{"input_ids":[{}]}}"#, long.join(","))).contains("context length"));
}

#[test]
fn neutral_values_of_unsupported_keys_pass() {
    parse(
        r#"{"input_ids":[1],"logprob_start_len":0,"top_logprobs_num":0,"sampling_params":{
            "frequency_penalty":0,"presence_penalty":0.0,"repetition_penalty":1,
            "min_new_tokens":0,"regex":null,"n":1,"include_stop_str_in_output":true}}"#,
    )
    .unwrap();
}

fn item(no_stop_trim: bool, return_logprob: bool) -> Item {
    Item {
        request: GenerateRequest {
            input_ids: vec![1],
            params: SamplingParams::default(),
            rid: Some("x".into()),
            return_routed_experts: false,
        },
        return_logprob,
        return_text_in_logprobs: false,
        skip_special_tokens: true,
        no_stop_trim,
    }
}

#[test]
fn response_shape() {
    let out = GenerateOutput {
        output_ids: vec![7, 9],
        logprobs: vec![-0.5, -1.5],
        finish: FinishReason::Stop,
        matched_stop: Some(MatchedStop::Token(9)),
        weight_version: 3,
        prompt_tokens: 1,
        cached_tokens: 0,
        routed_experts: None,
    };
    let r = generate_response(&item(false, true), out, None, 0.25);
    let v = serde_json::to_value(&r).unwrap();
    assert!(v.get("text").is_none());
    assert_eq!(v["output_ids"], serde_json::json!([7, 9]));
    assert_eq!(
        v["meta_info"]["finish_reason"],
        serde_json::json!({"type":"stop","matched":9})
    );
    assert_eq!(v["meta_info"]["weight_version"], "3");
    assert_eq!(v["meta_info"]["completion_tokens"], 2);
    assert_eq!(
        v["meta_info"]["output_token_logprobs"],
        serde_json::json!([[-0.5, 7, null], [-1.5, 9, null]])
    );
    let out = GenerateOutput {
        output_ids: vec![7],
        logprobs: vec![-0.5],
        ..GenerateOutput::default()
    };
    let v = serde_json::to_value(generate_response(&item(false, false), out, None, 0.0)).unwrap();
    assert_eq!(
        v["meta_info"]["finish_reason"],
        serde_json::json!({"type":"length","matched":null,"length":1})
    );
    assert!(v["meta_info"].get("output_token_logprobs").is_none());
}
