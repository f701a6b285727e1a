use super::*;

fn args(line: &str) -> Vec<OsString> {
    std::iter::once("wasmtron")
        .chain(line.split_whitespace())
        .map(OsString::from)
        .collect()
}

#[test]
fn a_production_command_line_parses_with_tritons_spellings() {
    let (cli, _) = parse(args(
        "--model-repository=/models --strict-model-config=false --log-verbose=1 \
         --log-info=1 --log-warning on --log-error=true --exit-on-error=0 \
         --model-load-thread-count=8 --http-thread-count=16 --allow-gpu-metrics=false \
         --metrics-interval-ms=2000 --pinned-memory-pool-byte-size=268435456 \
         --cuda-memory-pool-byte-size=0:67108864 --backend-directory=/opt/tritonserver/backends \
         --backend-config=python,shm-default-byte-size=10485760 \
         --backend-config=onnxruntime,default-max-batch-size=8 --id=prod-1 \
         --grpc-keepalive-time=10000 --rate-limit=off --allow-grpc 1",
    ))
    .unwrap();
    assert_eq!(cli.model_repository, ["/models"]);
    assert!(!cli.disable_auto_complete_config && !cli.exit_on_error && cli.log_warning);
    assert_eq!(
        (cli.id.as_str(), cli.http_thread_count),
        ("prod-1", Some(16))
    );
    assert_eq!(cli.grpc_keepalive_time, 10_000);
    assert_eq!(cli.model_load_thread_count, 8);
    assert_eq!(cli.rate_limit, RateLimit::Off);
    assert!(rate_limiter(&cli).unwrap().is_none());
    let (backend, notes) = BackendSettings::parse(&cli.backend_config).unwrap();
    assert_eq!(backend.default_max_batch_size, 8);
    assert!(notes[0].contains("no stub process"), "{notes:?}");
}

#[test]
fn flags_for_what_is_not_served_are_refused_by_name() {
    for (line, says) in [
        (
            "--cache-config=redis,host=localhost",
            "the redis cache needs host and port",
        ),
        (
            "--cache-config=redis,host=h,port=1 --cache-config=local,size=10",
            "one cache at a time",
        ),
        (
            "--rate-limit-resource=R:1",
            "--rate-limit-resource needs --rate-limit=execution_count",
        ),
        (
            "--rate-limit=execution_count --rate-limit-resource=R",
            "expected <name>:<count>[:<device>]",
        ),
        ("--http-header-forward-pattern=.*", "not forwarded"),
    ] {
        let e = parse(args(&format!("--model-repository=/m {line}")))
            .and_then(|(cli, _)| rate_limiter(&cli).map(|_| ()))
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains(says), "{e}");
    }
    assert!(parse(args("--model-repository=/m --allow-http=maybe")).is_err());
    assert!(parse(args("--model-repository=/m --grpc-use-ssl")).is_err());
    let e = BackendSettings::parse(&["onnxruntime,bogus=1".into()]).unwrap_err();
    assert!(e
        .to_string()
        .contains("unknown setting 'bogus' for backend 'onnxruntime'"));
    let e = BackendSettings::parse(&["nosuch,x=1".into()]).unwrap_err();
    assert!(e.to_string().contains("unknown backend 'nosuch'"));
}

#[test]
fn the_manual_says_what_each_triton_only_flag_does() {
    let readme = include_str!("../../../docs/command-line.md");
    for (flag, _) in TRITON_ONLY {
        assert!(
            readme.contains(&format!("`--{flag}")),
            "docs/command-line.md lacks --{flag}"
        );
    }
}

#[test]
fn booleans_take_tritons_spellings() {
    for (v, b) in [
        ("true", true),
        ("ON", true),
        ("1", true),
        ("False", false),
        ("off", false),
        ("0", false),
    ] {
        assert_eq!(triton_bool(v), Ok(b));
    }
    assert!(triton_bool("yes").is_err());
}

#[test]
fn control_modes_and_namespacing_parse_as_tritons_qa_scripts_spell_them() {
    // L0_model_namespacing starts Triton with upper-case modes and `=true`.
    let (cli, _) = parse(args(
        "--model-namespacing=true --model-repository=/a --model-repository=/b \
         --model-control-mode=POLL --repository-poll-secs=2",
    ))
    .unwrap();
    assert!(cli.model_namespacing);
    assert_eq!(cli.model_control_mode, ControlMode::Poll);
    let (cli, _) = parse(args("--model-repository=/a --model-control-mode=EXPLICIT")).unwrap();
    assert_eq!(cli.model_control_mode, ControlMode::Explicit);
    assert!(!cli.model_namespacing);
}
