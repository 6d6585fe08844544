//! A page's crops and the order the classifier and the recogniser take them in:
//! rapidocr's batches (ascending width/height ratio, `cls_batch_num` or
//! `rec_batch_num` at a time), one batch per slice, so a job's runs are exactly the
//! runs [`crate::read_page`] makes for the page.

use crate::{batch::plan_batches, bgr::BgrImage};

/// Crops with their planned batches and how far the job got through them.
#[derive(Debug, Clone)]
pub(super) struct CropBatches {
    crops: Vec<BgrImage>,
    batches: Vec<Vec<usize>>,
    next: usize,
}

impl CropBatches {
    /// The crops in rapidocr's batches of `batch_size`.
    pub fn planned(crops: Vec<BgrImage>, batch_size: usize) -> CropBatches {
        let batches = plan_batches(&crops, batch_size);
        CropBatches { crops, batches, next: 0 }
    }

    /// The crops with nothing to run on them (the classifier switched off).
    pub fn unplanned(crops: Vec<BgrImage>) -> CropBatches {
        CropBatches { crops, batches: Vec::new(), next: 0 }
    }

    pub fn is_done(&self) -> bool {
        self.next >= self.batches.len()
    }

    /// Indices of the crops the next slice runs (empty once done).
    pub fn next_batch(&self) -> &[usize] {
        self.batches.get(self.next).map_or(&[], Vec::as_slice)
    }

    pub fn next_crops(&self) -> impl Iterator<Item = &BgrImage> {
        self.next_batch().iter().filter_map(|&i| self.crops.get(i))
    }

    /// Moves on to the next batch, once this one's answers are kept.
    pub fn advance(&mut self) {
        self.next += 1;
    }

    pub fn len(&self) -> usize {
        self.crops.len()
    }

    pub fn crops(&self) -> &[BgrImage] {
        &self.crops
    }

    /// Replaces crop `i` by what `change` makes of it.
    pub fn change(&mut self, i: usize, change: impl FnOnce(BgrImage) -> BgrImage) {
        if let Some(slot) = self.crops.get_mut(i) {
            let crop = std::mem::replace(slot, BgrImage::filled(0, 0, [0; 3]));
            *slot = change(crop);
        }
    }

    /// Frees crop `i`'s pixels (read, no longer needed).
    pub fn release(&mut self, i: usize) {
        self.change(i, |_| BgrImage::filled(0, 0, [0; 3]));
    }

    /// Pixel bytes held, plus the plan.
    pub fn byte_size(&self) -> usize {
        let pixels: usize = self.crops.iter().map(|c| c.data().len()).sum();
        let plan: usize = self.batches.iter().map(|b| b.len() * std::mem::size_of::<usize>()).sum();
        pixels + plan + self.crops.len() * std::mem::size_of::<BgrImage>()
    }

    pub fn into_crops(self) -> Vec<BgrImage> {
        self.crops
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batches_run_in_ratio_order_and_released_crops_free_their_pixels() {
        let crops: Vec<BgrImage> =
            [(100, 10), (20, 10), (50, 10)].iter().map(|&(w, h)| BgrImage::filled(w, h, [9; 3])).collect();
        let mut plan = CropBatches::planned(crops, 2);
        assert_eq!(plan.next_batch(), [1, 2]);
        assert_eq!(plan.next_crops().map(BgrImage::width).collect::<Vec<_>>(), [20, 50]);
        let before = plan.byte_size();
        plan.release(1);
        assert_eq!(before - plan.byte_size(), 20 * 10 * 3);
        plan.advance();
        assert_eq!((plan.next_batch(), plan.is_done()), (&[0][..], false));
        plan.advance();
        assert!(plan.is_done() && plan.next_batch().is_empty());
        assert!(CropBatches::unplanned(vec![BgrImage::filled(1, 1, [0; 3])]).is_done());
        assert!(CropBatches::planned(Vec::new(), 6).is_done());
    }
}
