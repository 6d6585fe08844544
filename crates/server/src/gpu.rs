//! GPUs through NVML, loaded at run time: a machine without the NVIDIA driver simply
//! has no GPU devices (that is not an error).

use std::sync::Arc;

use nvml_wrapper::{enums::device::UsedGpuMemory, Nvml};
use snooze_core::{
    memory::{LimitSource, MemoryProbe, MemorySnapshot},
    Device,
};

/// One NVIDIA GPU's memory: total, free, and what this process holds on it.
pub struct NvmlProbe {
    nvml: Arc<Nvml>,
    index: u32,
}

impl MemoryProbe for NvmlProbe {
    fn snapshot(&self) -> MemorySnapshot {
        let Ok(device) = self.nvml.device_by_index(self.index) else { return MemorySnapshot::default() };
        let Ok(info) = device.memory_info() else { return MemorySnapshot::default() };
        let pid = std::process::id();
        let process_bytes = device
            .running_compute_processes()
            .unwrap_or_default()
            .iter()
            .filter(|p| p.pid == pid)
            .map(|p| match p.used_gpu_memory {
                UsedGpuMemory::Used(b) => b,
                UsedGpuMemory::Unavailable => 0,
            })
            .sum();
        MemorySnapshot {
            total_bytes: info.total,
            available_bytes: info.free,
            process_bytes,
            source: LimitSource::Machine,
        }
    }
}

/// Every GPU NVML can see, each with its probe; none when there is no driver.
pub fn detect() -> Vec<(Device, Arc<dyn MemoryProbe>)> {
    let nvml = match Nvml::init() {
        Ok(n) => Arc::new(n),
        Err(e) => {
            tracing::info!(reason = %e, "no NVIDIA driver found: serving on the CPU only");
            return Vec::new();
        }
    };
    let count = nvml.device_count().unwrap_or(0);
    (0..count)
        .map(|index| {
            let probe: Arc<dyn MemoryProbe> = Arc::new(NvmlProbe { nvml: nvml.clone(), index });
            let snap = probe.snapshot();
            tracing::info!(device = %Device::Cuda(index), total_bytes = snap.total_bytes, free_bytes = snap.available_bytes, "GPU found");
            (Device::Cuda(index), probe)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    #[test]
    fn no_driver_means_no_gpus_not_an_error() {
        // On machines with a driver this lists the GPUs; without one it must be empty
        // and must not panic.
        let gpus = super::detect();
        if std::path::Path::new("/proc/driver/nvidia").exists() {
            assert!(!gpus.is_empty());
        } else {
            assert!(gpus.is_empty());
        }
    }
}
