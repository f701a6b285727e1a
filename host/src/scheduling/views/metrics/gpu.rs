//! Triton's GPU metrics (`--allow-gpu-metrics`, on by default), in a build with the `cuda`
//! feature: per GPU (label `gpu_uuid`), `nv_gpu_utilization`, `nv_gpu_memory_total_bytes`,
//! `nv_gpu_memory_used_bytes`, `nv_gpu_power_usage`, `nv_gpu_power_limit` and
//! `nv_energy_consumption` (joules since the server started), read through NVML when the
//! metrics are scraped. NVML is loaded at run time (`libnvidia-ml.so`, the driver's), so the
//! build needs no GPU; a host without a driver or GPU reports nothing. Without the feature
//! [`render`] is empty.

/// The GPU metrics in the Prometheus text format (empty without NVML or GPUs). Blocking:
/// call it off the async runtime.
#[cfg(feature = "cuda")]
pub fn render() -> String {
    use std::{collections::HashMap, fmt::Write as _, sync::Mutex, sync::OnceLock};

    static NVML: OnceLock<Option<nvml_wrapper::Nvml>> = OnceLock::new();
    /// Each GPU's energy counter (mJ) at the first scrape, the origin of "since started".
    static ENERGY_AT_START: OnceLock<Mutex<HashMap<String, u64>>> = OnceLock::new();
    let Some(nvml) = NVML
        .get_or_init(|| match nvml_wrapper::Nvml::init() {
            Ok(n) => Some(n),
            Err(e) => {
                tracing::info!("GPU metrics are not reported: NVML is not available ({e})");
                None
            }
        })
        .as_ref()
    else {
        return String::new();
    };
    let origins = ENERGY_AT_START.get_or_init(Default::default);
    /// A family: name, help, and one value per GPU (by UUID).
    type Family = (&'static str, &'static str, Vec<(String, f64)>);
    let mut rows: [Family; 6] = [
        (
            "nv_gpu_utilization",
            "GPU utilization rate [0.0 - 1.0)",
            Vec::new(),
        ),
        (
            "nv_gpu_memory_total_bytes",
            "GPU total memory, in bytes",
            Vec::new(),
        ),
        (
            "nv_gpu_memory_used_bytes",
            "GPU used memory, in bytes",
            Vec::new(),
        ),
        ("nv_gpu_power_usage", "GPU power usage in watts", Vec::new()),
        (
            "nv_gpu_power_limit",
            "GPU power management limit in watts",
            Vec::new(),
        ),
        (
            "nv_energy_consumption",
            "GPU energy consumption in joules since the Triton Server started",
            Vec::new(),
        ),
    ];
    for index in 0..nvml.device_count().unwrap_or(0) {
        let Ok(device) = nvml.device_by_index(index) else {
            continue;
        };
        let Ok(uuid) = device.uuid() else {
            continue;
        };
        if let Ok(u) = device.utilization_rates() {
            rows[0].2.push((uuid.clone(), f64::from(u.gpu) / 100.0));
        }
        if let Ok(m) = device.memory_info() {
            rows[1].2.push((uuid.clone(), m.total as f64));
            rows[2].2.push((uuid.clone(), m.used as f64));
        }
        if let Ok(mw) = device.power_usage() {
            rows[3].2.push((uuid.clone(), f64::from(mw) / 1000.0));
        }
        if let Ok(mw) = device.enforced_power_limit() {
            rows[4].2.push((uuid.clone(), f64::from(mw) / 1000.0));
        }
        if let Ok(mj) = device.total_energy_consumption() {
            let mut origins = origins.lock().unwrap_or_else(|p| p.into_inner());
            let start = *origins.entry(uuid.clone()).or_insert(mj);
            rows[5]
                .2
                .push((uuid, mj.saturating_sub(start) as f64 / 1000.0));
        }
    }
    let mut out = String::new();
    for (name, help, values) in rows.iter().filter(|r| !r.2.is_empty()) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge");
        for (uuid, value) in values {
            let _ = writeln!(out, "{name}{{gpu_uuid=\"{uuid}\"}} {value}");
        }
    }
    out
}

/// Without the `cuda` feature there are no GPU metrics.
#[cfg(not(feature = "cuda"))]
pub fn render() -> String {
    String::new()
}
