//! The registry against real objects under `/dev/shm`: links, FIFOs, truncation, replacement.

use std::path::PathBuf;

use super::{posix_object::shm_path, *};

#[test]
fn links_fifos_and_truncated_objects_are_refused() {
    let key = format!("wasmtron-unit-link-{}", std::process::id());
    let link = PathBuf::from(SHM_DIR).join(&key);
    let victim = std::env::temp_dir().join(format!("{key}-victim"));
    std::fs::write(&victim, b"secret").unwrap();
    std::os::unix::fs::symlink(&victim, &link).unwrap();
    let shm = SystemSharedMemory::new();
    let err = shm.register(&Caller::Anyone, "r", &key, 0, 6).unwrap_err();
    assert!(err.message.contains("symbolic link"), "{err:?}");
    std::fs::remove_file(&link).unwrap();
    std::fs::remove_file(&victim).unwrap();

    std::fs::write(&link, vec![7u8; 64]).unwrap();
    shm.register(&Caller::Anyone, "r", &key, 0, 64).unwrap();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&link)
        .unwrap()
        .set_len(8)
        .unwrap();
    let params = Parameters::from([
        (REGION.into(), ParamValue::String("r".into())),
        (BYTE_SIZE.into(), ParamValue::Int(32)),
    ]);
    let reader = shm.reader(&Caller::Anyone, 1 << 20);
    let err = reader.input("x", &params).unwrap_err();
    assert!(err.message.contains("truncated"), "{err:?}");
    std::fs::remove_file(&link).unwrap();
}

#[test]
fn an_object_replaced_or_hard_linked_is_refused() {
    let key = format!("wasmtron-unit-swap-{}", std::process::id());
    let path = PathBuf::from(SHM_DIR).join(&key);
    std::fs::write(&path, vec![1u8; 64]).unwrap();
    let shm = SystemSharedMemory::new();
    shm.register(&Caller::Anyone, "r", &key, 0, 64).unwrap();
    std::fs::remove_file(&path).unwrap();
    std::fs::write(&path, vec![2u8; 64]).unwrap();
    let params = Parameters::from([
        (REGION.into(), ParamValue::String("r".into())),
        (BYTE_SIZE.into(), ParamValue::Int(64)),
    ]);
    let err = shm
        .reader(&Caller::Anyone, 1 << 20)
        .input("x", &params)
        .unwrap_err();
    assert!(err.message.contains("was replaced"), "{err:?}");
    let twin = PathBuf::from(SHM_DIR).join(format!("{key}-twin"));
    std::fs::hard_link(&path, &twin).unwrap();
    let err = shm.register(&Caller::Anyone, "t", &key, 0, 8).unwrap_err();
    assert!(err.message.contains("2 names"), "{err:?}");
    std::fs::remove_file(&twin).unwrap();
    std::fs::remove_file(&path).unwrap();
}

#[test]
fn one_request_reads_at_most_its_size_limit() {
    let key = format!("wasmtron-unit-budget-{}", std::process::id());
    let path = PathBuf::from(SHM_DIR).join(&key);
    std::fs::write(&path, vec![1u8; 64]).unwrap();
    let shm = SystemSharedMemory::new();
    shm.register(&Caller::Anyone, "r", &key, 0, 64).unwrap();
    let params = Parameters::from([
        (REGION.into(), ParamValue::String("r".into())),
        (BYTE_SIZE.into(), ParamValue::Int(64)),
    ]);
    let reader = shm.reader(&Caller::Anyone, 100);
    assert!(reader.input("a", &params).unwrap().is_some());
    let err = reader.input("b", &params).unwrap_err();
    assert!(err.message.contains("more than 100 bytes"), "{err:?}");
    std::fs::remove_file(&path).unwrap();
}

#[test]
fn keys_are_single_names_in_dev_shm() {
    assert_eq!(
        shm_path("/input0").unwrap(),
        PathBuf::from("/dev/shm/input0")
    );
    assert_eq!(shm_path("out").unwrap(), PathBuf::from("/dev/shm/out"));
    for bad in ["", "/", "/../etc/passwd", "/a/b", "..", "/.."] {
        let err = shm_path(bad).unwrap_err();
        assert!(
            err.message.contains("POSIX shared memory name"),
            "{bad}: {err:?}"
        );
    }
}

#[test]
fn inputs_and_outputs_round_trip_through_a_region() {
    let key = format!("wasmtron-unit-{}", std::process::id());
    let path = PathBuf::from(SHM_DIR).join(&key);
    std::fs::write(&path, vec![0u8; 64]).unwrap();
    let shm = SystemSharedMemory::new();
    let anyone = Caller::Anyone;
    shm.register(&anyone, "r", &format!("/{key}"), 8, 32)
        .unwrap();
    let dup = shm.register(&anyone, "r", &key, 0, 8).unwrap_err();
    assert!(
        dup.message
            .contains("shared memory region 'r' already in manager"),
        "{dup:?}"
    );

    let params = |region: &str, size: i64, offset: i64| {
        Parameters::from([
            (REGION.into(), ParamValue::String(region.into())),
            (BYTE_SIZE.into(), ParamValue::Int(size)),
            (OFFSET.into(), ParamValue::Int(offset)),
        ])
    };
    let response = InferResponse {
        model_name: "m".into(),
        model_version: 1,
        last: false,
        id: String::new(),
        parameters: Parameters::new(),
        outputs: vec![crate::tensor::Tensor {
            name: "y".into(),
            datatype: crate::tensor::DataType::Uint8,
            shape: vec![4],
            data: Bytes::from_static(&[1, 2, 3, 4]),
        }],
    };
    let requested = vec![RequestedOutput {
        name: "y".into(),
        parameters: params("r", 4, 4),
    }];
    shm.write_outputs(&anyone, &requested, &response).unwrap();
    let reported = output_parameters(&requested, "y", 4).unwrap();
    assert_eq!(reported[BYTE_SIZE], ParamValue::Int(4));
    // Region offset 8 + tensor offset 4: byte 12 of the object.
    assert_eq!(&std::fs::read(&path).unwrap()[12..16], &[1, 2, 3, 4]);
    let reader = shm.reader(&anyone, 1 << 20);
    let back = reader.input("x", &params("r", 4, 4)).unwrap().unwrap();
    assert_eq!(&back[..], &[1, 2, 3, 4]);

    let past = reader.input("x", &params("r", 8, 30)).unwrap_err();
    assert!(
        past.message
            .contains("Invalid offset + byte size for shared memory region: 'r'"),
        "{past:?}"
    );
    let missing = reader.input("x", &params("nope", 4, 0)).unwrap_err();
    assert!(missing.message.contains("'nope'"), "{missing:?}");
    let status = shm.status(&anyone, Kind::System, None).unwrap();
    assert_eq!(status[0].byte_size, 32);
    assert!(shm.status(&anyone, Kind::Cuda, None).unwrap().is_empty());
    shm.unregister(&anyone, Kind::Cuda, None).unwrap();
    assert_eq!(shm.status(&anyone, Kind::System, None).unwrap().len(), 1);
    // The reader (a request) still holds "r": unregistering marks it, dropping the reader
    // removes it.
    shm.unregister(&anyone, Kind::System, None).unwrap();
    assert_eq!(shm.status(&anyone, Kind::System, None).unwrap().len(), 1);
    let held = reader.into_held();
    assert_eq!(shm.status(&anyone, Kind::System, None).unwrap().len(), 1);
    drop(held);
    assert!(shm.status(&anyone, Kind::System, Some("r")).is_err());
    std::fs::remove_file(path).unwrap();
}

#[test]
fn cuda_regions_say_what_is_missing_on_a_cpu_host() {
    if crate::runtime::gpu::device_count().is_ok() {
        return; // a GPU build on a GPU host
    }
    let shm = SystemSharedMemory::new();
    let err = shm
        .register_cuda(&Caller::Anyone, "g", &[0; 64], 0, 64)
        .unwrap_err();
    assert_eq!(err.code, Code::Unsupported);
    assert!(
        err.message
            .starts_with("CUDA shared memory is not available"),
        "{err:?}"
    );
    #[cfg(feature = "cuda")]
    assert!(err.message.contains("NVIDIA driver"), "{err:?}");
    #[cfg(not(feature = "cuda"))]
    assert!(err.message.contains("--features cuda"), "{err:?}");
}
