//! `ai.snooze.PanelMatMul`: the operator the mapped copy's rewritten MatMuls run as.
//!
//! `Y = PanelMatMul(A, Wp)`: `A` a `M x K` batch, `Wp` a `K x N` weight stored as panels
//! (`[N / 16, K, 16]`, see `panels`), `Y` the `M x N` product, computed by `panel_gemm`
//! from the panels where they lie (a mapping) on the session's intra-op threads. Every
//! session this backend creates registers it (`domain`): a copy that uses it loads only
//! where it is registered, and a copy without it is unaffected.

use ort::{
    operator::{
        BoxedKernel, ComputeContext, KernelContext, Operator, OperatorDomain, OperatorInput, OperatorOutput,
    },
    value::TensorElementType,
};

use crate::{panel_gemm::Product, panels::PANEL};

/// The operator's domain, as the rewritten model imports it.
pub(crate) const DOMAIN: &str = "ai.snooze";
/// The domain's version the rewritten model imports.
pub(crate) const VERSION: u64 = 1;
/// The operator's name.
pub(crate) const NAME: &str = "PanelMatMul";

/// Weight bytes a unit of work of the threads covers at least: a panel of a short `K`
/// is a few KiB, and one call per panel would cost more than it computes. A unit has an
/// even number of panels (the AVX-512 kernel takes them two at a time).
const UNIT_BYTES: usize = 64 << 10;

/// The domain with the operator, for a session builder (`with_operators`).
pub(crate) fn domain() -> ort::Result<OperatorDomain> {
    OperatorDomain::new(DOMAIN)?.add(PanelMatMul)
}

struct PanelMatMul;

impl Operator for PanelMatMul {
    type Kernel<'attr> = BoxedKernel<'attr>;

    fn name(&self) -> &str {
        NAME
    }

    fn inputs(&self) -> impl IntoIterator<Item = OperatorInput> {
        [
            OperatorInput::required(TensorElementType::Float32),
            OperatorInput::required(TensorElementType::Float32),
        ]
    }

    fn outputs(&self) -> impl IntoIterator<Item = OperatorOutput> {
        [OperatorOutput::required(TensorElementType::Float32)]
    }

    fn create_kernel<'attr>(&self, _: &KernelContext<'attr>) -> ort::Result<Self::Kernel<'attr>> {
        Ok(Box::new(compute))
    }
}

fn compute(ctx: &ComputeContext) -> ort::Result<()> {
    let missing = |what: &str| ort::Error::new(format!("{NAME}: no {what}"));
    let a = ctx.input(0)?.ok_or_else(|| missing("batch"))?;
    let w = ctx.input(1)?.ok_or_else(|| missing("weight"))?;
    let (a_shape, a) = a.try_extract_tensor::<f32>()?;
    let (w_shape, w) = w.try_extract_tensor::<f32>()?;
    let dims = |s: &[i64]| s.iter().map(|&d| usize::try_from(d).ok()).collect::<Option<Vec<_>>>();
    let (m, k, n) = match (dims(a_shape).as_deref(), dims(w_shape).as_deref()) {
        (Some(&[m, k]), Some(&[panels, wk, PANEL])) if wk == k => (m, k, panels * PANEL),
        _ => {
            return Err(ort::Error::new(format!(
                "{NAME}: a batch of shape {a_shape:?} cannot be multiplied by panels of shape {w_shape:?} \
                 (expected [M, K] and [N / {PANEL}, K, {PANEL}])"
            )))
        }
    };
    let out_shape = vec![m as i64, n as i64];
    let mut out = ctx.output(0, out_shape)?.ok_or_else(|| missing("output"))?;
    let (_, c) = out.try_extract_tensor_mut::<f32>()?;
    let product = Product::new(a, w, c, m, k, n).map_err(|e| ort::Error::new(format!("{NAME}: {e}")))?;
    let panels = product.panels();
    let per_unit = UNIT_BYTES.div_ceil(k.max(1) * PANEL * 4).next_multiple_of(2).min(panels.max(1));
    let units = panels.div_ceil(per_unit);
    ctx.par_for(units, 0, |u| {
        let first = u * per_unit;
        // SAFETY: each unit has panels of its own.
        unsafe { product.run_panels(first..(first + per_unit).min(panels)) }
    })
}
