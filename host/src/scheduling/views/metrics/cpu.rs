//! Triton's CPU metrics (`--allow-cpu-metrics`, on by default): `nv_cpu_utilization`, the
//! share of the host's CPU time that was not idle since the previous scrape (since boot on the
//! first), and `nv_cpu_memory_total_bytes` / `nv_cpu_memory_used_bytes` (total less available
//! memory), read from `/proc` when the metrics are scraped. Nothing is reported where `/proc`
//! cannot be read.

use std::sync::Mutex;

/// The previous scrape's (busy, total) CPU time, in clock ticks.
static PREVIOUS: Mutex<Option<(u64, u64)>> = Mutex::new(None);

/// The CPU metrics in the Prometheus text format (empty where `/proc` is not readable).
pub fn render() -> String {
    let mut out = String::new();
    if let Some(now) = std::fs::read_to_string("/proc/stat")
        .ok()
        .and_then(|t| cpu_times(&t))
    {
        let mut previous = PREVIOUS
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let (busy, total) = match *previous {
            Some((b, t)) if now.1 > t => (now.0.saturating_sub(b), now.1 - t),
            _ => now,
        };
        *previous = Some(now);
        let utilization = if total == 0 {
            0.0
        } else {
            busy as f64 / total as f64
        };
        gauge(
            &mut out,
            "nv_cpu_utilization",
            "CPU utilization rate [0.0 - 1.0]",
            utilization,
        );
    }
    if let Some((total, used)) = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|t| memory(&t))
    {
        gauge(
            &mut out,
            "nv_cpu_memory_total_bytes",
            "CPU total memory (RAM), in bytes",
            total as f64,
        );
        gauge(
            &mut out,
            "nv_cpu_memory_used_bytes",
            "CPU used memory (RAM), in bytes",
            used as f64,
        );
    }
    out
}

fn gauge(out: &mut String, name: &str, help: &str, value: f64) {
    out.push_str(&format!(
        "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {value}\n"
    ));
}

/// (busy, total) clock ticks of every CPU from `/proc/stat`'s first line; idle and iowait are
/// not busy, steal and guest time are not counted twice.
fn cpu_times(stat: &str) -> Option<(u64, u64)> {
    let line = stat.lines().next()?.strip_prefix("cpu ")?;
    let fields: Vec<u64> = line
        .split_whitespace()
        .map(|f| f.parse().ok())
        .collect::<Option<_>>()?;
    // user nice system idle iowait irq softirq steal [guest guest_nice] (guest time is already
    // in user and nice).
    let total: u64 = fields.iter().take(8).sum();
    let idle = fields.get(3)? + fields.get(4).copied().unwrap_or(0);
    Some((total.saturating_sub(idle), total))
}

/// (total, used) bytes from `/proc/meminfo`: `MemTotal` and `MemTotal - MemAvailable`.
fn memory(meminfo: &str) -> Option<(u64, u64)> {
    let field = |name: &str| -> Option<u64> {
        meminfo
            .lines()
            .find_map(|l| l.strip_prefix(name))?
            .trim()
            .trim_end_matches("kB")
            .trim()
            .parse::<u64>()
            .ok()
            .map(|kib| kib * 1024)
    };
    let total = field("MemTotal:")?;
    let available = field("MemAvailable:")?;
    Some((total, total.saturating_sub(available)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proc_files_are_read_as_the_kernel_writes_them() {
        let stat = "cpu  100 5 50 800 20 3 2 0 0 0\ncpu0 50 2 25 400 10 1 1 0 0 0\n";
        assert_eq!(cpu_times(stat), Some((160, 980)));
        assert_eq!(cpu_times("intr 1 2 3\n"), None);
        let meminfo =
            "MemTotal:       24000000 kB\nMemFree:  100 kB\nMemAvailable:   16000000 kB\n";
        assert_eq!(memory(meminfo), Some((24_000_000 * 1024, 8_000_000 * 1024)));
        assert!(render().contains("nv_cpu_memory_total_bytes"));
    }
}
