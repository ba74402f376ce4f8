use super::*;
use manta_core::algo::{AdvantageEstimator, KlType};

/// The message `validate` gives for `o`, read from `file` with key `prefix`.
fn validation_error(o: &TrainOverrides, file: &str, prefix: &str) -> String {
    o.validate(Path::new(file), prefix)
        .expect_err("invalid overrides")
        .to_string()
}

#[test]
fn upper_layer_wins_and_defaults_fill_the_rest() {
    let flags = TrainOverrides {
        lr: Some(0.01),
        ..Default::default()
    };
    let file = TrainOverrides {
        lr: Some(0.5),
        n_samples: Some(4),
        ..Default::default()
    };
    let s = flags.over(file).unwrap().resolve();
    assert_eq!(s.lr, 0.01);
    assert_eq!(s.n_samples, 4);
    assert_eq!(s.rollout_batch_size, 32);
    assert_eq!(s.eps_clip_high, 0.2);
}

#[test]
fn an_empty_wandb_project_is_named() {
    let o = TrainOverrides {
        wandb_project: Some(" ".into()),
        ..Default::default()
    };
    let err = validation_error(&o, "command line", "--");
    assert!(
        err.contains("--wandb-project") && err.contains("must not be empty"),
        "{err}"
    );
}

#[test]
fn zero_and_out_of_range_values_are_named() {
    let o = TrainOverrides {
        n_samples: Some(0),
        ..Default::default()
    };
    let err = validation_error(&o, "command line", "--");
    assert!(
        err.contains("--n-samples") && err.contains("at least 1"),
        "{err}"
    );
    let o = TrainOverrides {
        adam_beta2: Some(1.5),
        ..Default::default()
    };
    let err = validation_error(&o, "c.toml", "train.");
    assert!(
        err.contains("train.adam_beta2") && err.contains("1.5"),
        "{err}"
    );
}

#[test]
fn zero_stage_is_2_or_3_and_defaults_to_2() {
    assert_eq!(TrainOverrides::default().resolve().zero_stage, 2);
    for stage in [2, 3] {
        let o = TrainOverrides {
            zero_stage: Some(stage),
            ..Default::default()
        };
        o.validate(Path::new("command line"), "--").unwrap();
        assert_eq!(o.resolve().zero_stage, stage);
    }
    for stage in [0, 1, 4] {
        let o = TrainOverrides {
            zero_stage: Some(stage),
            ..Default::default()
        };
        let err = validation_error(&o, "command line", "--");
        assert!(
            err.contains("--zero-stage") && err.contains(&stage.to_string()),
            "{err}"
        );
        let err = validation_error(&o, "c.toml", "train.");
        assert!(err.contains("train.zero_stage"), "{err}");
    }
}

#[test]
fn grad_reduce_in_bf16_defaults_to_off_and_a_layer_turns_it_on() {
    assert!(!TrainOverrides::default().resolve().grad_reduce_in_bf16);
    let on = TrainOverrides {
        grad_reduce_in_bf16: Some(true),
        ..Default::default()
    };
    assert!(on.clone().resolve().grad_reduce_in_bf16);
    // cluster.toml's `[train] grad_reduce_in_bf16 = true` under an unset flag.
    assert!(
        TrainOverrides::default()
            .over(on)
            .unwrap()
            .resolve()
            .grad_reduce_in_bf16
    );
    let file: TrainOverrides = toml::from_str("grad_reduce_in_bf16 = true").unwrap();
    assert_eq!(file.grad_reduce_in_bf16, Some(true));
}

#[test]
fn context_parallel_size_defaults_to_1_and_refuses_0() {
    assert_eq!(TrainOverrides::default().resolve().context_parallel_size, 1);
    let o = TrainOverrides {
        context_parallel_size: Some(2),
        ..Default::default()
    };
    o.validate(Path::new("command line"), "--").unwrap();
    assert_eq!(o.resolve().context_parallel_size, 2);
    let zero = TrainOverrides {
        context_parallel_size: Some(0),
        ..Default::default()
    };
    let err = validation_error(&zero, "command line", "--");
    assert!(
        err.contains("--context-parallel-size") && err.contains('0'),
        "{err}"
    );
    let err = validation_error(&zero, "c.toml", "train.");
    assert!(err.contains("train.context_parallel_size"), "{err}");
}

#[test]
fn loss_flags_layer_and_bad_choices_are_named() {
    let flags = TrainOverrides {
        use_kl_loss: Some(true),
        kl_loss_type: Some(KlType::LowVarKl),
        ..Default::default()
    };
    let file = TrainOverrides {
        kl_loss_type: Some(KlType::K2),
        kl_loss_coef: Some(0.01),
        ..Default::default()
    };
    let s = flags.over(file).unwrap().resolve();
    assert!(s.algo.use_kl_loss);
    assert_eq!(s.algo.kl_loss_type, KlType::LowVarKl);
    assert_eq!(s.algo.kl_loss_coef, 0.01);
    assert_eq!(s.algo.advantage_estimator, AdvantageEstimator::Grpo);
    assert_eq!((s.algo.tis_clip, s.algo.tis_clip_low), (2.0, 0.0));
    assert_eq!(s.algo.num_steps_per_rollout, 1);
    // An unknown choice cannot reach a layer: a [train] table naming one does not parse.
    let err = toml::from_str::<TrainOverrides>("advantage_estimator = \"ppo\"")
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("advantage_estimator") && err.contains("ppo") && err.contains("gspo"),
        "{err}"
    );
    let bad = TrainOverrides {
        eps_clip_c: Some(0.5),
        ..Default::default()
    };
    let err = validation_error(&bad, "c.toml", "train.");
    assert!(
        err.contains("train.eps_clip_c") && err.contains("> 1"),
        "{err}"
    );
    let bad = TrainOverrides {
        tis_clip: Some(1.0),
        tis_clip_low: Some(2.0),
        ..Default::default()
    };
    let err = validation_error(&bad, "command line", "--");
    assert!(err.contains("--tis-clip-low"), "{err}");
}

#[test]
fn recompute_flags_resolve_as_megatron_and_bad_values_are_named() {
    // Default: the cookbook's gradient checkpointing, every layer.
    let every = Some(LayerRecompute {
        method: "uniform".into(),
        num_layers: 1,
    });
    assert_eq!(TrainOverrides::default().resolve().recompute, every);
    let off = TrainOverrides {
        gradient_checkpointing: Some(false),
        ..Default::default()
    };
    assert_eq!(off.clone().resolve().recompute, None);
    // The recompute flags win over gradient_checkpointing, from any layer.
    let block = TrainOverrides {
        recompute_granularity: Some("full".into()),
        recompute_method: Some("block".into()),
        recompute_num_layers: Some(30),
        ..Default::default()
    };
    block.validate(Path::new("c.toml"), "train.").unwrap();
    let s = block.clone().over(off).unwrap().resolve();
    assert_eq!(
        s.recompute,
        Some(LayerRecompute {
            method: "block".into(),
            num_layers: 30
        })
    );
    let selective = TrainOverrides {
        recompute_granularity: Some("selective".into()),
        ..Default::default()
    };
    assert_eq!(
        selective.over(block.clone()).unwrap().resolve().recompute,
        None
    );

    let bad_method = TrainOverrides {
        recompute_method: Some("blocks".into()),
        ..block.clone()
    };
    let err = validation_error(&bad_method, "command line", "--");
    assert!(
        err.contains("--recompute-method")
            && err.contains("\"blocks\"")
            && err.contains("uniform, block"),
        "{err}"
    );
    let bad_granularity = TrainOverrides {
        recompute_granularity: Some("partial".into()),
        ..Default::default()
    };
    let err = validation_error(&bad_granularity, "c.toml", "train.");
    assert!(
        err.contains("train.recompute_granularity") && err.contains("\"partial\""),
        "{err}"
    );
    let zero = TrainOverrides {
        recompute_num_layers: Some(0),
        ..block.clone()
    };
    let err = validation_error(&zero, "command line", "--");
    assert!(
        err.contains("--recompute-num-layers") && err.contains("at least 1"),
        "{err}"
    );
    let no_method = TrainOverrides {
        recompute_method: None,
        ..block.clone()
    };
    let err = validation_error(&no_method, "command line", "--");
    assert!(
        err.contains("--recompute-granularity") && err.contains("--recompute-method"),
        "{err}"
    );
    let no_layers = TrainOverrides {
        recompute_num_layers: None,
        ..block.clone()
    };
    let err = validation_error(&no_layers, "c.toml", "train.");
    assert!(err.contains("train.recompute_num_layers"), "{err}");
    let orphan = TrainOverrides {
        recompute_num_layers: Some(4),
        ..Default::default()
    };
    let err = validation_error(&orphan, "command line", "--");
    assert!(
        err.contains("--recompute-num-layers")
            && err.contains('4')
            && err.contains("--recompute-granularity"),
        "{err}"
    );
    let selective_with_layers = TrainOverrides {
        recompute_granularity: Some("selective".into()),
        recompute_num_layers: Some(2),
        ..Default::default()
    };
    let err = validation_error(&selective_with_layers, "command line", "--");
    assert!(
        err.contains("--recompute-num-layers") && err.contains("only with"),
        "{err}"
    );
}

#[test]
fn sampling_options_default_resolve_and_bad_values_are_named() {
    let s = TrainOverrides {
        rollout_batch_size: Some(6),
        ..Default::default()
    }
    .resolve();
    assert_eq!(s.sampling.over_sampling_batch_size, 6);
    assert_eq!(s.sampling.dynamic_sampling_filter, None);
    assert_eq!(
        (s.sampling.max_weight_staleness, s.sampling.partial_rollout),
        (0, false)
    );
    let s = TrainOverrides {
        dynamic_sampling_filter_path: Some(
            "slime.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std".into(),
        ),
        partial_rollout: Some(true),
        over_sampling_batch_size: Some(64),
        ..Default::default()
    }
    .resolve();
    assert_eq!(
        s.sampling.dynamic_sampling_filter.as_deref(),
        Some("check_reward_nonzero_std")
    );
    assert_eq!(s.sampling.over_sampling_batch_size, 64);
    assert_eq!(s.sampling.max_weight_staleness, 1);
    let bad = TrainOverrides {
        dynamic_sampling_filter_path: Some("my.module.keep_all".into()),
        ..Default::default()
    };
    let err = validation_error(&bad, "c.toml", "train.");
    assert!(
        err.contains("train.dynamic_sampling_filter_path")
            && err.contains("my.module.keep_all")
            && err.contains("check_reward_nonzero_std"),
        "{err}"
    );
    let bad = TrainOverrides {
        over_sampling_batch_size: Some(0),
        ..Default::default()
    };
    let err = validation_error(&bad, "command line", "--");
    assert!(err.contains("--over-sampling-batch-size"), "{err}");
    let bad = TrainOverrides {
        partial_rollout: Some(true),
        max_weight_staleness: Some(0),
        ..Default::default()
    };
    let err = validation_error(&bad, "command line", "--");
    assert!(
        err.contains("--max-weight-staleness") && err.contains("at least 1"),
        "{err}"
    );
}

/// Each setting is declared once, as a field of [`TrainOverrides`]: that field is both the
/// flag (with its help text) and the `[train]` key, so the two lists cannot drift apart. A
/// field whose flag were renamed, hidden or missing, or a key renamed by serde, fails here.
#[test]
fn every_setting_is_one_flag_and_one_train_key() {
    use clap::Args;
    let command = TrainOverrides::augment_args(clap::Command::new("settings"));
    let flags: std::collections::BTreeSet<String> = command
        .get_arguments()
        .filter(|arg| !arg.is_hide_set())
        .filter_map(|arg| arg.get_long().map(|long| long.replace('-', "_")))
        .collect();
    let keys: std::collections::BTreeSet<String> =
        match serde_json::to_value(TrainOverrides::default()) {
            Ok(serde_json::Value::Object(map)) => map.keys().cloned().collect(),
            other => panic!("TrainOverrides serialized as {other:?}"),
        };
    assert_eq!(flags, keys, "flags (left) and [train] keys (right) differ");
    assert!(keys.len() > 60, "only {} settings found", keys.len());
    // Every key parses back from a [train] table: the schema is these fields.
    for key in &keys {
        let text = format!("{key} = \"x\"");
        let err = toml::from_str::<TrainOverrides>(&text)
            .map(|_| ())
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(!err.contains("unknown field"), "{key}: {err}");
    }
}

/// A flag given as a switch is `Some(true)`; absent it leaves the lower layer's value.
#[test]
fn switches_set_true_and_absent_switches_leave_the_lower_layer() {
    use clap::{Args, FromArgMatches};
    let parse = |argv: &[&str]| {
        let command = TrainOverrides::augment_args(clap::Command::new("settings"));
        let matches = command.try_get_matches_from(argv).expect("parses");
        TrainOverrides::from_arg_matches(&matches).expect("settings")
    };
    let on = parse(&["settings", "--use-kl-loss", "--lr", "0.5"]);
    assert_eq!((on.use_kl_loss, on.lr), (Some(true), Some(0.5)));
    let file = TrainOverrides {
        use_kl_loss: Some(false),
        use_tis: Some(true),
        ..Default::default()
    };
    let merged = parse(&["settings"]).over(file.clone()).unwrap();
    assert_eq!(
        (merged.use_kl_loss, merged.use_tis),
        (Some(false), Some(true))
    );
    let merged = on.over(file).unwrap();
    assert_eq!((merged.use_kl_loss, merged.lr), (Some(true), Some(0.5)));
}
